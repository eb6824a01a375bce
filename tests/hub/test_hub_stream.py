"""Hub inputs read by HTTP Range (issue 15): only the bytes the plan needs, equal to the local-path merge."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from support import cli, digests, write_config

from hub.conftest import REPO, Model
from hub.fakehub import FakeHub, files_of, iter_requests
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.fetching import needed_ranges
from resumerge.merge.plan.merge_plan import PlanOptions

DEEP = ModelSpec(layers=6, hidden=32, intermediate=48, vocab=64, shard_bytes=10**9)  # one file: auto streams it
DEEP_REPO = "org/deep"
OTHER = "org/beta"


def _weights(out: Path) -> dict[str, str]:
    """Digests of the shards, index and config.json (the card and YAML name the model as it was given)."""
    return {k: v for k, v in digests(out).items() if k.endswith((".safetensors", ".index.json", "config.json"))}


def _slice(model: str) -> dict[str, object]:
    return {"merge_method": "passthrough", "dtype": "float32",
            "slices": [{"sources": [{"model": model, "layer_range": [0, 2]}]}]}


def _used_tensor_bytes(directory: Path, layers: range) -> tuple[int, int]:
    """(bytes of the tensors a slice of ``layers`` uses, bytes of every shard's header) of a local model."""
    used = headers = 0
    for shard in sorted(directory.glob("*.safetensors")):
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        headers += 8 + n
        for name, entry in json.loads(raw[8:8 + n]).items():
            if name == "__metadata__":
                continue
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            if layer is None or int(layer) in layers:
                used += entry["data_offsets"][1] - entry["data_offsets"][0]
    return used, headers


@pytest.fixture
def deep(tmp_path_factory: pytest.TempPathFactory, hub: FakeHub) -> Path:
    """A 6-layer model in several shards, pushed to the stand-in hub as ``org/deep``; returns its folder."""
    directory = make_model(tmp_path_factory.mktemp("deep") / "m", DEEP, seed=3)
    hub.push(DEEP_REPO, files_of(directory))
    return directory


def test_slice_streams_only_the_needed_bytes(tmp_path: Path, hub: FakeHub, deep: Path, state: Path,
                                            hf_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local_out, hub_out = tmp_path / "local", tmp_path / "hub"
    args = ["--state-dir", str(state), "--quiet"]
    assert main(["run", str(write_config(tmp_path / "l.yml", _slice(str(deep)))), str(local_out), *args]) == 0
    hub.reset_counters()
    assert main(["run", str(write_config(tmp_path / "h.yml", _slice(DEEP_REPO))), str(hub_out), *args]) == 0

    assert _weights(hub_out) == _weights(local_out)
    used, headers = _used_tensor_bytes(deep, range(0, 2))
    fetched = sum(v for k, v in hub.file_bytes().items() if k.endswith(".safetensors"))
    assert fetched <= 1.1 * used + headers, (fetched, used, headers)
    assert fetched >= used
    cached = [p for p in (hf_env / "hub").rglob("*") if p.is_file() and p.suffix != ".lock"]
    blobs = {p.name for p in cached if p.parent.name == "blobs"}
    assert not any(p.name.endswith(".safetensors") for p in (hf_env / "hub").rglob("*.safetensors")), cached
    assert all(len(name) != 64 for name in blobs), "no LFS (weight) blob may land in the cache"

    capsys.readouterr()
    assert main(["status", str(hub_out), "--state-dir", str(state), "--json"]) == 0
    streamed = json.loads(capsys.readouterr().out)["streamed"]
    assert (streamed["fetched"], streamed["needed"]) == (fetched - headers, used)
    assert main(["status", str(hub_out), "--state-dir", str(state)]) == 0
    assert "streamed" in capsys.readouterr().out


def _linear(a: str, b: str) -> dict[str, object]:
    return {"merge_method": "linear", "dtype": "float32",
            "models": [{"model": a, "parameters": {"weight": 0.3}}, {"model": b, "parameters": {"weight": 0.7}}]}


def _shard_bytes(hub: FakeHub) -> int:
    return sum(v for k, v in hub.file_bytes().items() if k.endswith(".safetensors"))


def test_streamed_linear_equals_download_and_resume_fetches_only_what_is_left(
        tmp_path: Path, hub: FakeHub, models: tuple[Model, Model], state: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    hub.push(OTHER, models[1].files)
    cfg = write_config(tmp_path / "c.yml", _linear(REPO, OTHER))
    shard = ["--out-shard-size", "10k"]
    assert main(["run", str(cfg), str(tmp_path / "dl"), "--state-dir", str(state), "--quiet", *shard]) == 0
    downloaded = _shard_bytes(hub)

    monkeypatch.setenv("HF_HOME", str(tmp_path / "home2"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "home2" / "hub"))
    hub.reset_counters()
    assert main(["run", str(cfg), str(tmp_path / "st"), "--state-dir", str(state), "--quiet", "--stream-inputs",
                 *shard]) == 0
    assert _weights(tmp_path / "st") == _weights(tmp_path / "dl")
    streamed = _shard_bytes(hub)
    assert streamed <= downloaded
    assert not list((tmp_path / "home2" / "hub").rglob("*.safetensors"))

    # SIGKILL a streaming run after its second shard, then resume on a "fresh machine" (an empty cache).
    out = tmp_path / "killed"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home3"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "home3" / "hub"))
    killed = cli("run", cfg, out, "--state-dir", state, "--quiet", "--stream-inputs", *shard,
                 env={"RESUMERGE_KILL_AT": "after_ledger_commit:2"})
    assert killed.returncode == -9, killed.stderr
    ledger = sqlite3.connect(next(state.glob(f"{out.name}-*/ledger.db")))
    done = [r[0] for r in ledger.execute("SELECT name FROM files WHERE status = 'done'")]
    ledger.close()
    assert len(done) == 2
    plan = plan_from_config(load_config_text(cfg.read_text()), PlanOptions(out_shard_size=10_000))
    left = sum(e - s for ranges in needed_ranges(plan, done).values() for s, e in ranges)
    headers = sum(Model(m.files).header_bytes(s) for m in models for s in m.shards)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home4"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "home4" / "hub"))
    hub.reset_counters()
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert _weights(out) == _weights(tmp_path / "dl")
    assert _shard_bytes(hub) <= 1.1 * left + headers, (_shard_bytes(hub), left, headers)
    assert not list((tmp_path / "home4" / "hub").rglob("*.safetensors"))


def test_plan_shows_the_choice_and_bytes_per_file(tmp_path: Path, hub: FakeHub, deep: Path, state: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "h.yml", _slice(DEEP_REPO))
    capsys.readouterr()
    assert main(["plan", str(cfg), "--json", "--probe-size", "0", "--state-dir", str(state)]) == 0
    doc = json.loads(capsys.readouterr().out)
    used, _ = _used_tensor_bytes(deep, range(0, 2))
    [entry] = doc["input_files"]
    assert (entry["how"], entry["fetch_bytes"], entry["needed"]) == ("stream", used, used)
    assert doc["download"]["bytes"] == 0
    assert main(["plan", str(cfg), "--probe-size", "0", "--state-dir", str(state)]) == 0
    assert f"{DEEP_REPO}/model.safetensors: stream" in capsys.readouterr().out.replace("\n", " ")


def test_auto_rule(tmp_path: Path, deep: Path) -> None:
    """Stream below half of a file; download otherwise unless it breaks --max-disk; cached files stay put."""
    from resumerge.merge.plan.fetching import choose_fetch

    whole = plan_from_config(load_config_text(json.dumps({"merge_method": "passthrough", "models": [str(deep)]})),
                             PlanOptions())
    part = plan_from_config(load_config_text(json.dumps(_slice(str(deep)))), PlanOptions())
    key = next(iter(whole.inputs))
    size = whole.inputs[key][0][1]
    assert [c.how for c in choose_fetch(part, [key])] == ["stream"]
    assert [c.how for c in choose_fetch(whole, [key])] == ["download"]
    assert [c.how for c in choose_fetch(whole, [key], max_disk=size - 1)] == ["stream"]
    assert [c.how for c in choose_fetch(whole, [key], max_disk=size)] == ["download"]
    assert [c.how for c in choose_fetch(whole, [key], stream=True)] == ["stream"]
    assert [c.how for c in choose_fetch(part, [key], cached=[(key, "model.safetensors")])] == ["cached"]
    assert choose_fetch(whole, []) == ()


def test_a_streamed_range_that_changes_after_a_kill_stops_the_resume(
        tmp_path: Path, hub: FakeHub, models: tuple[Model, Model], state: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    hub.push(OTHER, models[1].files)
    cfg = write_config(tmp_path / "c.yml", _linear(REPO, OTHER))
    out = tmp_path / "out"
    killed = cli("run", cfg, out, "--state-dir", state, "--quiet", "--stream-inputs", "--out-shard-size", "10k",
                 env={"RESUMERGE_KILL_AT": "mid_shard_write:1"})
    assert killed.returncode == -9, killed.stderr
    ledger = sqlite3.connect(next(state.glob(f"{out.name}-*/ledger.db")))
    reads = ledger.execute("SELECT file, start, \"end\" FROM stream_reads WHERE model = ?", [REPO]).fetchall()
    ledger.close()
    assert reads
    # The hub now serves other bytes under the same pinned commit (what a content hash alone can catch).
    files = hub.repos[REPO].commits[hub.repos[REPO].branches["main"]]
    for file, start, end in reads:
        data = bytearray(files[file])
        data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
        files[file] = bytes(data)
    capsys.readouterr()
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 4
    err = capsys.readouterr().err
    assert f"input {REPO} file model-0000" in err and "other bytes" in err


def _stream_source(hub: FakeHub, deep: Path, granted: list[int] | None) -> tuple[object, list[tuple[int, int]]]:
    from resumerge.inputs.hub import hub_settings
    from resumerge.inputs.hub.ranges import RangeClient
    from resumerge.inputs.hub.remote import resolve_revision
    from resumerge.inputs.hub.stream import HubStream

    settings = hub_settings(endpoint=hub.url)
    commit = resolve_revision(settings, DEEP_REPO, "main")
    raw = (deep / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    spans = sorted((8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1])
                   for k, e in json.loads(raw[8:8 + n]).items() if k != "__metadata__")
    released: list[int] = []

    def reserve(nbytes: int) -> object:
        if granted is None:
            return None
        granted.append(nbytes)
        return lambda: released.append(nbytes)

    source = HubStream(deep, {"model.safetensors": RangeClient(settings, DEEP_REPO, commit, "model.safetensors",
                                                               len(raw))},
                       reserve=reserve, coalesce_bytes=30_000)  # type: ignore[arg-type]
    source.expect([("model.safetensors", s, e) for s, e in spans])
    for s, e in spans:
        assert bytes(source.read_range("model.safetensors", s, e).numpy()) == raw[s:e]
    source.close()
    return released, spans


def test_read_ahead_is_coalesced_only_when_the_governor_grants_it(hub: FakeHub, deep: Path) -> None:
    granted: list[int] = []
    released, spans = _stream_source(hub, deep, granted)
    coalesced = [r for r in iter_requests(hub, "GET") if r.range]
    assert 1 < len(coalesced) < len(spans) / 3
    assert all(r.sent <= 30_000 for r in coalesced)
    assert granted and sorted(granted) == sorted(released), "every read-ahead grant is given back"
    hub.reset_counters()
    _stream_source(hub, deep, None)  # no room: one request per tensor, nothing held ahead
    assert len([r for r in iter_requests(hub, "GET") if r.range]) == len(spans)


def _whole(model: str) -> dict[str, object]:
    return {"merge_method": "passthrough", "dtype": "float32",
            "slices": [{"sources": [{"model": model, "layer_range": [0, 6]}]}]}


def test_a_file_read_whole_is_checked_against_the_hub_checksum(tmp_path: Path, hub: FakeHub, deep: Path,
                                                              state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "w.yml", _whole(DEEP_REPO))
    args = ["--state-dir", str(state), "--quiet", "--stream-inputs"]
    assert main(["run", str(cfg), str(tmp_path / "ok"), *args]) == 0
    ledger = sqlite3.connect(next(state.glob("ok-*/ledger.db")))
    events = [r[0] for r in ledger.execute("SELECT message FROM events WHERE kind = 'verify'")]
    ledger.close()
    assert events == [f"{DEEP_REPO}/model.safetensors: every byte streamed, checksum matches the hub's"]

    # The cache's file list (written by the first run) keeps the old sha256; the hub now serves other tensor bytes.
    files = hub.repos[DEEP_REPO].commits[hub.repos[DEEP_REPO].branches["main"]]
    raw = bytearray(files["model.safetensors"])
    raw[-4:] = bytes(b ^ 0xFF for b in raw[-4:])
    files["model.safetensors"] = bytes(raw)
    capsys.readouterr()
    assert main(["run", str(cfg), str(tmp_path / "bad"), *args]) == 4
    assert f"{DEEP_REPO}/model.safetensors does not match the hub's checksum" in capsys.readouterr().err


def test_file_digest_takes_ranges_in_any_order() -> None:
    import hashlib

    from resumerge.inputs.hub.integrity import FileDigest

    data = bytes(range(256)) * 40
    results: list[bool] = []
    digest = FileDigest("f", len(data), hashlib.sha256(data).hexdigest(), results.append)
    for start, end in [(4000, 8000), (0, 100), (50, 4100), (8000, len(data)), (10, 20)]:
        digest.feed(start, data[start:end])
    assert results == [True]
    git = FileDigest("g", len(data), hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), results.append)
    git.feed(0, data)
    assert results == [True, True]


def test_file_digest_spills_what_comes_early_past_its_memory_bound(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A check reads a file's head (at its end) first, larger than what a digest may hold: kept on disk, not given up.
    import hashlib

    from resumerge.inputs.hub import integrity

    monkeypatch.setattr(integrity, "MAX_HELD", 1000)
    data = bytes(range(256)) * 40
    results: list[bool] = []
    spill = tmp_path / "early"
    digest = integrity.FileDigest("f", len(data), hashlib.sha256(data).hexdigest(), results.append, spill=spill)
    for start, end in [(8000, len(data)), (8000, len(data)), (7500, 7600), (4000, 7500), (0, 4000), (7600, 8000)]:
        digest.feed(start, data[start:end])
        if start == 4000:
            assert len(list(spill.iterdir())) == 2  # the two larger early ranges (each held once), the small one kept
    assert results == [True] and digest.complete and not list(spill.iterdir())
    bound = integrity.FileDigest("g", len(data), hashlib.sha256(data).hexdigest(), results.append)
    bound.feed(2000, data[2000:])
    assert bound.abandoned  # without a folder to spill to, it gives up as before (the merge)
    changed = integrity.FileDigest("h", len(data), hashlib.sha256(data).hexdigest(), results.append, spill=spill)
    changed.feed(5000, data[5000:6000] + b"x" + data[6001:])
    with pytest.raises(integrity.StreamedInputChanged, match="does not match the hub's checksum"):
        changed.feed(0, data[:5000])
    assert results == [True, False] and not list(spill.iterdir())


def test_stream_inputs_on_a_recipe_is_refused(tmp_path: Path, deep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.yml"
    recipe.write_text(f"name: a\nmerge_method: passthrough\nmodels:\n  - model: {deep}\n---\n"
                      "merge_method: passthrough\nmodels:\n  - model: a\n")
    capsys.readouterr()
    assert main(["run", str(recipe), str(tmp_path / "out"), "--stream-inputs", "--quiet"]) == 2
    assert "--stream-inputs applies to single merges" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
