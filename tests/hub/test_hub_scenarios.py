"""The issue's scenarios against the stand-in hub, each asserting the body bytes the hub served."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import try_to_load_from_cache

from hub.conftest import BIG_REPO, REPO, Model
from hub.fakehub import FakeHub, iter_requests
from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError, StorageError
from resumerge.inputs.hub import HubEvent, RepoMetadata, fetch_weights, resolve_metadata
from resumerge.inputs.hub.download import DOWNLOAD_CHUNK
from resumerge.inputs.hub.headers import parse_header

ALPHA = ModelRef(REPO)
BIG = ModelRef(BIG_REPO)
CHUNK = DOWNLOAD_CHUNK  # downloads write what they receive in pieces of this size


def resolve_all(state: Path, ref: ModelRef = ALPHA, **kwargs: object) -> tuple[RepoMetadata, dict[str, Path]]:
    """Phase one then phase two, as the planner calls them."""
    events: list[HubEvent] = kwargs.pop("events", [])  # type: ignore[assignment]
    meta = resolve_metadata(ref, records_dir=state, on_progress=events.append, **kwargs)  # type: ignore[arg-type]
    return meta, fetch_weights(meta, records_dir=state, on_progress=events.append)


def header_of(model: Model, shard: str) -> object:
    n = int.from_bytes(model.files[shard][:8], "little")
    return parse_header(model.files[shard][8 : 8 + n], len(model.files[shard]), shard)


def blob_of(path: Path) -> Path:
    return path.resolve()


def test_first_run_fetches_only_needed_files(hub: FakeHub, models: tuple[Model, Model], state: Path) -> None:
    model = models[0]
    events: list[HubEvent] = []
    meta = resolve_metadata(ALPHA, records_dir=state, on_progress=events.append)

    # Phase one: the small files in full, and only 8 + header bytes of each shard (HTTP Range).
    assert meta.weight_files == tuple(model.shards)
    expected = {f"{REPO}/{p}": len(model.files[p]) for p in model.small}
    expected |= {f"{REPO}/{s}": model.header_bytes(s) for s in model.shards}
    assert hub.file_bytes() == expected
    assert dict(meta.headers) == {s: header_of(model, s) for s in model.shards}
    assert meta.config_path is not None and json.loads(meta.config_path.read_text())["num_hidden_layers"] == 2

    paths = fetch_weights(meta, records_dir=state, on_progress=events.append)

    # Phase two adds the rest of each shard: its download starts from the header bytes phase one read, so every
    # byte of a shard is served exactly once. No decoy was requested at all, not even with HEAD.
    for s in model.shards:
        expected[f"{REPO}/{s}"] = len(model.files[s])
    assert hub.file_bytes() == expected
    touched = {r.path for r in iter_requests(hub)}
    for decoy in ("pytorch_model.bin", "model.gguf", "onnx/model.onnx", "flax_model.msgpack", "tf_model.h5",
                  "original/consolidated.safetensors", "README.md"):
        assert not any(t.endswith(decoy) for t in touched), decoy

    # Everything sits in the normal huggingface_hub cache, where huggingface_hub itself finds it.
    for s, path in paths.items():
        assert path.read_bytes() == model.files[s]
        assert path.is_symlink() and blob_of(path).parent.name == "blobs"
        cached = try_to_load_from_cache(REPO, s, revision=meta.commit)
        assert isinstance(cached, str) and Path(cached) == path
    assert (meta.snapshot_dir.parents[1] / "refs" / "main").read_text() == meta.commit
    assert (meta.snapshot_dir.parents[1] / "trees" / f"{meta.commit}.json").is_file()

    downloads = [e for e in events if e.kind == "download" and e.filename == model.shards[0]]
    assert downloads[-1].done == downloads[-1].total == len(model.files[model.shards[0]])
    # Each file's end is told once: a small file arrives in one chunk, and its "downloading X" was shown twice.
    finished = [e.filename for e in events if e.kind == "download" and e.done == e.total]
    assert len(finished) == len(set(finished)) and set(model.small) <= set(finished)
    assert not list((meta.snapshot_dir.parents[1] / "blobs").glob("*.incomplete"))


def test_second_resolve_serves_nothing(hub: FakeHub, state: Path) -> None:
    meta, first = resolve_all(state)
    hub.reset_counters()

    # A resume (pinned commit) with everything cached and verified makes no request at all.
    again, paths = resolve_all(state, pinned_commit=meta.commit)
    assert list(iter_requests(hub)) == []
    assert paths == first and again.headers == meta.headers

    # A new run asks only which commit the branch is at now (one small API answer), and no file bytes.
    _, paths = resolve_all(state)
    assert [(r.method, r.path) for r in iter_requests(hub)] == [("GET", f"/api/models/{REPO}/revision/main")]
    assert hub.file_bytes() == {}


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("which", ["shard", "config.json"])
def test_damaged_blob_is_fetched_again_alone(
    hub: FakeHub, models: tuple[Model, Model], state: Path, damage: str, which: str
) -> None:
    model = models[0]
    meta, paths = resolve_all(state)
    name = model.shards[1] if which == "shard" else "config.json"
    local = paths.get(name) or meta.local_files[name]
    blob = blob_of(local)
    size = blob.stat().st_size
    if damage == "flip":
        with open(blob, "r+b") as f:  # a byte near the end: in tensor data for a shard
            f.seek(size - 3)
            byte = f.read(1)
            f.seek(size - 3)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.truncate(blob, size // 2)
    hub.reset_counters()
    events: list[HubEvent] = []

    _, paths = resolve_all(state, pinned_commit=meta.commit, events=events)

    served = len(model.files[name])
    if which == "shard" and damage == "flip":
        # The header was read from the cached copy (of the right size): the download starts from those bytes (the
        # whole file's checksum covers them). A truncated shard's header is read from the hub meanwhile, and its
        # download starts from that read: each byte served once either way.
        served -= model.header_bytes(name)
    assert hub.file_bytes() == {f"{REPO}/{name}": served}
    assert (paths.get(name) or meta.local_files[name]).read_bytes() == model.files[name]
    assert [e.filename for e in events if e.kind == "refetch"] == [name]


def test_offline_resolution_from_cache(
    hub: FakeHub, models: tuple[Model, Model], state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta, paths = resolve_all(state)
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    offline_meta, offline_paths = resolve_all(state)  # the branch name, resolved through refs/main

    assert offline_meta.commit == meta.commit and offline_paths == paths
    assert offline_meta.headers == meta.headers and offline_meta.settings.offline

    # Without the tree listing (an older cache) the snapshot folder stands in.
    (meta.snapshot_dir.parents[1] / "trees" / f"{meta.commit}.json").unlink()
    scanned, scanned_paths = resolve_all(state)
    assert not scanned.listing_complete and scanned_paths == paths


def test_offline_damage_names_file_and_repair_command(
    hub: FakeHub, models: tuple[Model, Model], state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta, paths = resolve_all(state)
    shard = models[0].shards[2]
    os.truncate(blob_of(paths[shard]), 100)
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    with pytest.raises(ModelInputError) as err:
        resolve_all(state)

    line = err.value.one_line()
    assert shard in line and "offline" in line
    assert f"hf download {REPO} {shard} --revision {meta.commit} --force-download" in line


def test_unreachable_hub_falls_back_to_cache(hub: FakeHub, state: Path) -> None:
    meta, paths = resolve_all(state)
    hub.stop()  # not offline by choice: the hub just does not answer
    events: list[HubEvent] = []

    again, again_paths = resolve_all(state, events=events)

    assert again.commit == meta.commit and again_paths == paths
    assert [e.kind for e in events if e.kind == "fallback"] == ["fallback"]


def test_dropped_connection_mid_file_is_survived(hub: FakeHub, big_model: Model, state: Path) -> None:
    size = len(big_model.files["model.safetensors"])
    head = big_model.header_bytes("model.safetensors")  # read by range in phase one: the download starts past it
    meta = resolve_metadata(BIG, records_dir=state)
    hub.reset_counters()
    hub.drop_after[f"{BIG_REPO}/model.safetensors"] = CHUNK + CHUNK // 5

    paths = fetch_weights(meta, records_dir=state)

    assert paths["model.safetensors"].read_bytes() == big_model.files["model.safetensors"]
    # The first chunk reached the disk before the cut; the retry asks for the rest with Range. Only the bytes
    # of the unfinished second chunk are served twice.
    assert hub.file_bytes() == {f"{BIG_REPO}/model.safetensors": size - head + CHUNK // 5}
    gets = [r.range for r in iter_requests(hub, "GET") if r.path.endswith("model.safetensors")]
    assert gets == [f"bytes={head}-", f"bytes={head + CHUNK}-"]


def test_dropped_connection_in_small_file_restarts_it(hub: FakeHub, models: tuple[Model, Model], state: Path) -> None:
    shard = models[0].shards[2]
    meta = resolve_metadata(ALPHA, records_dir=state)
    hub.reset_counters()
    hub.drop_after[f"{REPO}/{shard}"] = 5_000

    paths = fetch_weights(meta, records_dir=state)

    assert paths[shard].read_bytes() == models[0].files[shard]
    # Less than one download chunk had arrived, so nothing was on disk to resume from but the header phase one read.
    assert hub.file_bytes()[f"{REPO}/{shard}"] == 5_000 + len(models[0].files[shard]) - models[0].header_bytes(shard)


def test_killed_download_resumes_in_the_next_process(hub: FakeHub, big_model: Model, state: Path) -> None:
    blob = big_model.files["model.safetensors"]
    head = big_model.header_bytes("model.safetensors")  # the download starts from the header phase one read
    partial = Path(os.environ["HF_HUB_CACHE"]) / "models--org--big" / "blobs" / (
        hashlib.sha256(blob).hexdigest() + ".resumerge.incomplete"
    )
    release = threading.Event()
    hub.hold_after[f"{BIG_REPO}/model.safetensors"] = (CHUNK + CHUNK // 5, release)
    script = (
        "import sys\n"
        "from resumerge.inputs.hub import fetch_weights, resolve_metadata\n"
        "from resumerge.config.modelref import ModelRef\n"
        "meta = resolve_metadata(ModelRef('org/big'), records_dir=sys.argv[1])\n"
        "fetch_weights(meta, records_dir=sys.argv[1])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", script, str(state)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size >= head + CHUNK):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no cleanup runs in the child
        proc.communicate()
        release.set()
    assert partial.stat().st_size == head + CHUNK

    meta = resolve_metadata(BIG, records_dir=state)
    hub.reset_counters()
    paths = fetch_weights(meta, records_dir=state)

    assert paths["model.safetensors"].read_bytes() == blob
    # The partial file is continued as it is (its header bytes are not written again).
    assert hub.file_bytes() == {f"{BIG_REPO}/model.safetensors": len(blob) - head - CHUNK}
    assert [r.range for r in iter_requests(hub, "GET") if r.path.endswith("model.safetensors")] == [
        f"bytes={head + CHUNK}-"]
    assert not partial.exists()


def test_dropped_connection_with_range_ignored_restarts_and_verifies(
    hub: FakeHub, models: tuple[Model, Model], state: Path
) -> None:
    model = models[0]
    shard = model.shards[0]
    meta = resolve_metadata(ALPHA, records_dir=state)
    hub.ignore_range = True  # the retry gets the whole file again: the partial must be rewritten
    hub.drop_after[f"{REPO}/{shard}"] = 5_000
    hub.reset_counters()

    paths = fetch_weights(meta, records_dir=state)

    assert paths[shard].read_bytes() == model.files[shard]
    assert hub.file_bytes()[f"{REPO}/{shard}"] == 5_000 + len(model.files[shard])


def test_branch_moved_after_pinning(hub: FakeHub, models: tuple[Model, Model], state: Path, tmp_path: Path) -> None:
    old, new = models
    meta, _ = resolve_all(state)
    new_commit = hub.push(REPO, new.files)
    hub.reset_counters()
    events: list[HubEvent] = []

    # Resume: exactly the pinned commit, from the cache, and it says so.
    resumed, paths = resolve_all(state, pinned_commit=meta.commit, events=events)
    assert resumed.commit == meta.commit and hub.file_bytes() == {}
    assert all(paths[s].read_bytes() == old.files[s] for s in old.shards)
    pinned = [e for e in events if e.kind == "pinned"]
    assert pinned and "moved" in pinned[0].message

    # Resume into an empty cache: still the pinned commit, fetched from the hub.
    fresh, fresh_paths = resolve_all(state, pinned_commit=meta.commit, cache_dir=tmp_path / "other-cache")
    assert fresh.commit == meta.commit
    assert all(fresh_paths[s].read_bytes() == old.files[s] for s in old.shards)

    # A new run follows the branch.
    moved, moved_paths = resolve_all(state)
    assert moved.commit == new_commit
    assert all(moved_paths[s].read_bytes() == new.files[s] for s in new.shards)


def test_free_disk_is_checked_before_downloading(
    hub: FakeHub, models: tuple[Model, Model], state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = resolve_metadata(ALPHA, records_dir=state)
    hub.reset_counters()
    monkeypatch.setattr("resumerge.inputs.hub.download.free_bytes", lambda path: 1_000)

    with pytest.raises(StorageError) as err:
        fetch_weights(meta, records_dir=state)

    need = sum(len(models[0].files[s]) for s in models[0].shards)
    assert f"{need:,} bytes" in err.value.message and "1,000 bytes" in err.value.message
    assert hub.file_bytes() == {}


def test_transformers_cache_dir_and_token(
    hub: FakeHub, state: Path, tmp_path: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    other = tmp_path / "transformers-cache"

    _, paths = resolve_all(state, cache_dir=other)

    assert all(other in p.parents for p in paths.values())
    assert not (hf_env / "hub" / "models--org--alpha").exists()
    assert {r.authorization for r in iter_requests(hub)} == {"Bearer hf_test_token"}
