"""In a run whose bytes cross the network the compute threads yield the CPU to the transfers: they lower their own
priority, and no thread that moves bytes takes a compute thread's (Linux gives each thread its creator's)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resumerge.inputs.hub import landing
from resumerge.inputs.hub.landing import Downloads
from resumerge.merge.engine import cpupriority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn: Any) -> Any:
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def test_only_the_calling_thread_yields() -> None:
    mine = _nice()

    def lowered() -> tuple[int, int]:
        before = _nice()
        cpupriority.yield_to_transfers()
        return before, _nice()

    before, after = _in_thread(lowered)
    assert before == mine and after == min(19, mine + cpupriority.COMPUTE_NICE)
    assert _nice() == mine  # the caller of the thread, like every other thread, is untouched


def test_a_download_a_yielding_reader_waits_for_starts_at_the_runs_priority(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second file is queued behind the first (one worker); a reader on a compute thread, which yielded, waits
    for it: its download starts at once, on a thread of the priority of the thread that started the downloads."""
    landed: dict[str, int] = {}
    release = threading.Event()

    def land(settings: Any, repo: Any, commit: str, remote: Any, records: Any, emit: Any, ld: Any,
             header: Any = None) -> Path:
        landed[remote.path] = _nice()
        if remote.path == "first":
            release.wait(10)  # still downloading when the reader asks for the second file
        ld.finished(tmp_path / remote.path)
        return tmp_path / remote.path

    monkeypatch.setattr(landing, "land_file", land)
    (tmp_path / "first").write_bytes(b"1")
    (tmp_path / "second").write_bytes(b"2")
    files = {name: SimpleNamespace(path=name, size=1) for name in ("first", "second")}
    meta = SimpleNamespace(repo_id="org/m", commit="c" * 40, files=files, settings=SimpleNamespace(cache_dir=tmp_path),
                           headers={})
    jobs: list[Any] = [("m", meta, "first"), ("m", meta, "second")]
    downloads = Downloads(jobs, records_dir=tmp_path, workers=1)
    mine = _nice()
    downloads.start([("m", "first"), ("m", "second")])
    try:
        def reader() -> int:
            cpupriority.yield_to_transfers()
            return int(downloads.landings["m", "second"].read(0, 1)[0])

        assert _in_thread(reader) == ord("2")
        assert landed["second"] == mine and landed["second"] < min(19, mine + cpupriority.COMPUTE_NICE)
        assert downloads.started == [("m", "first"), ("m", "second")]
        # Nothing is left to ask for: the starter ends by itself (a notebook's runs leave no thread behind).
        deadline = time.monotonic() + 10
        while any(t.name == "resumerge-download-starter" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the download starter outlived its queue"
            time.sleep(0.05)
    finally:
        release.set()
        downloads.close()
    assert landed["first"] == mine
