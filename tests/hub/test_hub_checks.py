"""Verification records, hashing once, header and index checks, and the errors users see."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from hub.conftest import REPO, Model
from hub.fakehub import FakeHub, git_blob_sha1, iter_requests
from resumerge.config.modelref import ModelRef
from resumerge.errors import HostileFileError, ModelInputError
from resumerge.inputs.hub import HubEvent, RemoteFile, fetch_weights, is_local, resolve_metadata
from resumerge.inputs.hub import verify as verify_module
from resumerge.inputs.hub.cache import RepoCache
from resumerge.inputs.hub.events import ByteMeter
from resumerge.inputs.hub.headers import header_length, parse_header
from resumerge.inputs.hub.records import RACY_WINDOW_NS, VerifyRecords
from resumerge.inputs.hub.verify import hash_file


def _old(path: Path, seconds: float = 10) -> None:
    stamp = time.time_ns() - int(seconds * 1e9)
    os.utime(path, ns=(stamp, stamp))


def test_record_is_trusted_until_the_file_changes(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(b"hello")
    _old(blob)
    with VerifyRecords(tmp_path / "state") as records:
        records.record(blob, "sha256", "abc", time.time_ns())
        assert records.trusted(blob, "sha256", "abc")
        assert not records.trusted(blob, "sha256", "other")
        blob.write_bytes(b"hellO")  # same size, new mtime
        assert not records.trusted(blob, "sha256", "abc")
    with VerifyRecords(tmp_path / "state") as reopened:  # persisted in the state dir
        assert not reopened.trusted(blob, "sha256", "abc")


def test_record_of_a_racily_fresh_file_is_not_trusted(tmp_path: Path) -> None:
    # A write within the timestamp granularity of the hash could keep the recorded mtime: hash again.
    blob = tmp_path / "blob"
    blob.write_bytes(b"x")
    with VerifyRecords(None) as records:
        records.record(blob, "sha256", "abc", time.time_ns())
        assert not records.trusted(blob, "sha256", "abc")
        records.record(blob, "sha256", "abc", blob.stat().st_mtime_ns + RACY_WINDOW_NS + 1)
        assert records.trusted(blob, "sha256", "abc")


def test_checksums_are_the_hubs(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"some content")
    assert hash_file(path, RemoteFile("f", 12, "")) == git_blob_sha1(b"some content")
    assert hash_file(path, RemoteFile("f", 12, "x", "y")) == hashlib.sha256(b"some content").hexdigest()


def _count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the repo path of every file that gets hashed from disk."""
    hashed: list[str] = []
    real = verify_module.hash_file

    def counting(path: Path, remote: RemoteFile, meter: ByteMeter | None = None) -> str:
        hashed.append(remote.path)
        return real(path, remote, meter)

    monkeypatch.setattr(verify_module, "hash_file", counting)
    return hashed


def test_verified_files_are_not_hashed_again(
    hub: FakeHub, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = resolve_metadata(ModelRef(REPO), records_dir=state)
    fetch_weights(meta, records_dir=state)
    hashed = _count_hashing(monkeypatch)

    again = resolve_metadata(ModelRef(REPO), records_dir=state, pinned_commit=meta.commit)
    fetch_weights(again, records_dir=state)

    assert hashed == []  # downloads were hashed while they arrived, and recorded


def test_without_records_every_run_hashes(hub: FakeHub, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meta = resolve_metadata(ModelRef(REPO), records_dir=state)
    fetch_weights(meta, records_dir=state)
    hashed = _count_hashing(monkeypatch)

    fetch_weights(meta, records_dir=None)

    assert sorted(hashed) == sorted(meta.weight_files)


def test_invalid_id_fails_without_any_request(hub: FakeHub) -> None:
    with pytest.raises(ModelInputError, match=r"^no such directory: './models/no such dir' \(relative to /") as e:
        resolve_metadata(ModelRef("./models/no such dir"))
    assert "Repo id must" not in str(e.value) and e.value.__cause__ is None  # huggingface_hub's words mislead
    assert list(iter_requests(hub)) == []
    assert is_local(ModelRef(str(Path(__file__).parent))) and not is_local(ModelRef(REPO))


@pytest.mark.parametrize(
    ("ref", "message"),
    [(ModelRef("org/missing"), "no such directory 'org/missing', nor a model repo of that name .a hub id like org"),
     (ModelRef(REPO, "no-such-branch"), "has no revision 'no-such-branch'")],
)
def test_unknown_repo_or_revision_is_an_input_error(hub: FakeHub, ref: ModelRef, message: str) -> None:
    with pytest.raises(ModelInputError, match=message):
        resolve_metadata(ref)


def test_offline_without_cache_is_an_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelInputError, match=r"not in the hub cache.*offline mode is on"):
        resolve_metadata(ModelRef(REPO))


def test_a_legacy_pickle_in_a_repo_without_safetensors_is_refused(hub: FakeHub,
                                                                  models: tuple[Model, Model]) -> None:
    """Without safetensors the repo's pytorch_model.bin is fetched, then refused unrun: not a zip checkpoint."""
    hub.push("org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x02" + b"0" * 100,
                             "training_args.bin": b"\x80\x02" + b"0" * 100})
    with pytest.raises(ModelInputError, match="not a readable zip-format PyTorch checkpoint"):
        resolve_metadata(ModelRef("org/pickled"))
    assert {r.path.rsplit("/", 1)[-1] for r in iter_requests(hub) if r.path.endswith(".bin")} == {"pytorch_model.bin"}


def test_index_naming_a_path_outside_the_repo_is_hostile(hub: FakeHub, models: tuple[Model, Model]) -> None:
    files = dict(models[0].files)
    index = json.loads(files["model.safetensors.index.json"])
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../escape.safetensors"
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    hub.push("org/hostile", files)
    with pytest.raises(HostileFileError, match="escape"):
        resolve_metadata(ModelRef("org/hostile"))


def test_header_that_lies_about_sizes_is_hostile(hub: FakeHub, models: tuple[Model, Model]) -> None:
    files = dict(models[0].files)
    shard = models[0].shards[0]
    files[shard] = (10**9).to_bytes(8, "little") + files[shard][8:]
    hub.push("org/liar", files)
    with pytest.raises(HostileFileError, match="claims a 1000000000-byte safetensors header"):
        resolve_metadata(ModelRef("org/liar"))
    with pytest.raises(HostileFileError, match="covers"):
        parse_header(b'{"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', 8 + 61 + 8, "f")
    assert header_length((5).to_bytes(8, "little"), None, "f") == 5


def test_tree_listing_round_trips_in_huggingface_hub_format(tmp_path: Path) -> None:
    repo = RepoCache(tmp_path, REPO)
    files = {"config.json": RemoteFile("config.json", 3, "a" * 40),
             "model.safetensors": RemoteFile("model.safetensors", 9, "b" * 40, "c" * 64)}
    repo.write_tree("d" * 40, files)
    assert repo.read_tree("d" * 40) == files
    raw = json.loads((repo.root / "trees" / ("d" * 40 + ".json")).read_text())
    assert raw["format_version"] == 1
    assert raw["files"]["model.safetensors"] == {"size": 9, "blob_id": "b" * 40, "lfs_sha256": "c" * 64,
                                                "lfs_size": 9}


def test_public_names_exist() -> None:
    import resumerge.inputs.hub as hub_api

    assert sorted(hub_api.__all__) == hub_api.__all__
    assert all(hasattr(hub_api, name) for name in hub_api.__all__)


def test_download_progress_reports_bytes_and_rate(hub: FakeHub, big_model: Model, state: Path) -> None:
    events: list[HubEvent] = []
    meta = resolve_metadata(ModelRef("org/big"), records_dir=state)
    fetch_weights(meta, records_dir=state, on_progress=events.append)
    size = len(big_model.files["model.safetensors"])
    progress = [e for e in events if e.kind == "download"]
    assert progress[-1].done == progress[-1].total == size and progress[-1].rate
    assert [e.done for e in progress] == sorted(e.done for e in progress)
