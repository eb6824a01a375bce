"""Range reads under hub faults (issue 15): expiring signed URLs, cut connections, 429, a server ignoring Range."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import digests, write_config

from hub.conftest import BIG_REPO, REPO, Model
from hub.fakehub import FakeHub, iter_requests
from resumerge.cli.commands import main
from resumerge.errors import EXIT_INTERRUPTED, exit_code_for
from resumerge.inputs.hub import hub_settings
from resumerge.inputs.hub.ranges import FetchCounters, RangeClient, RetryPolicy
from resumerge.inputs.hub.remote import resolve_revision

FILE = "model.safetensors"


def _client(hub: FakeHub, data: bytes, waits: list[float], **policy: float) -> RangeClient:
    settings = hub_settings(endpoint=hub.url)
    commit = resolve_revision(settings, BIG_REPO, "main")
    return RangeClient(settings, BIG_REPO, commit, FILE, len(data), counters=FetchCounters(),
                       policy=RetryPolicy(**policy), sleep=waits.append)  # type: ignore[arg-type]


def test_signed_url_is_reused_and_refreshed_when_it_expires(hub: FakeHub, big_model: Model) -> None:
    data, waits = big_model.files[FILE], []
    client = _client(hub, data, waits)
    hub.signed_uses = 2
    for start in range(0, 6000, 1000):
        assert client.read(start, start + 1000) == data[start:start + 1000]
    resolves = [r for r in iter_requests(hub, "GET") if "/resolve/" in r.path]
    assert len(resolves) == 3, "one resolve, then one per expired signature (2 reads each)"
    assert hub.expired == 2 and client.counters.refreshed_urls == 2 and not waits
    assert all(r.authorization is None for r in iter_requests(hub) if r.path.startswith("/_signed/"))


def test_threads_sharing_a_file_never_use_up_each_others_signed_urls(hub: FakeHub, big_model: Model,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Single-use signed URLs and another thread's read landing before each request of this one: a fresh URL is
    # used by the read that asked for it before the others may take it, and an expired one sends each read back to
    # the hub rather than to the URL another thread just shared (and used). Before, the reads took each other's
    # URLs and one gave up with "the hub kept redirecting" (the whole suite met it once, under load).
    data, waits = big_model.files[FILE], []
    client = _client(hub, data, waits)
    hub.signed_uses = 1
    real, rival = client._read_into, []

    def another_thread_first(*request: Any) -> None:
        if not rival:
            rival.append(True)
            try:
                assert client.read(0, 100) == data[:100]
            finally:
                rival.pop()
        real(*request)

    monkeypatch.setattr(client, "_read_into", another_thread_first)
    for start in range(0, 6000, 1000):
        assert client.read(start, start + 1000) == data[start:start + 1000]
    assert not waits


def test_cut_connection_continues_from_the_bytes_received(hub: FakeHub, big_model: Model) -> None:
    data, waits = big_model.files[FILE], []
    client = _client(hub, data, waits)
    hub.drop_after[f"{BIG_REPO}/{FILE}"] = 300_000
    assert client.read(10, 1_000_010) == data[10:1_000_010]
    ranges = [r.range for r in iter_requests(hub, "GET") if r.range]
    assert ranges == ["bytes=10-1000009", "bytes=300010-1000009"]
    assert waits == [0.5]  # one backoff step


def test_429_waits_for_retry_after(hub: FakeHub, big_model: Model) -> None:
    data, waits = big_model.files[FILE], []
    client = _client(hub, data, waits)
    hub.throttle, hub.retry_after = 2, "7"
    assert client.read(100, 200) == data[100:200]
    assert waits == [7.0, 7.0]


def test_server_ignoring_range_never_corrupts_a_tensor(hub: FakeHub, big_model: Model) -> None:
    data, waits = big_model.files[FILE], []
    client = _client(hub, data, waits)
    hub.ignore_range = True
    assert client.read(5000, 9000) == data[5000:9000]
    assert client.read(0, 16) == data[:16]


def test_retries_run_out_with_a_resumable_error(hub: FakeHub, big_model: Model) -> None:
    data, waits = big_model.files[FILE], []
    client = _client(hub, data, waits, attempts=3)
    hub.throttle = 10
    with pytest.raises(Exception) as info:
        client.read(0, 100)
    assert exit_code_for(info.value) == EXIT_INTERRUPTED
    assert "3 attempts" in str(info.value) and hub.url not in str(info.value)


def test_streamed_merge_under_every_fault_equals_the_clean_one(tmp_path: Path, hub: FakeHub, state: Path,
                                                              models: tuple[Model, Model]) -> None:
    hub.push("org/beta", models[1].files)
    cfg = write_config(tmp_path / "c.yml", {
        "merge_method": "linear", "dtype": "float32",
        "models": [{"model": REPO, "parameters": {"weight": 0.3}},
                   {"model": "org/beta", "parameters": {"weight": 0.7}}],
    })
    args = ["--state-dir", str(state), "--quiet", "--stream-inputs", "--out-shard-size", "10k"]
    assert main(["run", str(cfg), str(tmp_path / "clean"), *args]) == 0
    hub.signed_uses, hub.throttle, hub.retry_after = 1, 2, "0"
    for shard in models[0].shards:
        hub.drop_after[f"{REPO}/{shard}"] = 5000
    assert main(["run", str(cfg), str(tmp_path / "faulty"), *args]) == 0
    assert hub.expired > 0 and hub.throttle == 0 and not hub.drop_after
    hub.signed_uses, hub.ignore_range = None, True
    assert main(["run", str(cfg), str(tmp_path / "norange"), *args]) == 0
    clean = digests(tmp_path / "clean")
    for name in ("faulty", "norange"):
        got = digests(tmp_path / name)
        assert {k: v for k, v in got.items() if k != "resumerge-manifest.json"} == {
            k: v for k, v in clean.items() if k != "resumerge-manifest.json"}
