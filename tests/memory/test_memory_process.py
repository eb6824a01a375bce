"""The real host: what SystemProbe counts, and a real process held under its budget by the governor."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resumerge.errors import UsageError
from resumerge.machine.memory import SystemProbe, os_peak_rss

MB = 10**6

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, resumerge.machine.memory; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_cuda_probe_refuses_without_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from resumerge.machine.memory import CudaProbe

    with pytest.raises(UsageError, match="no CUDA GPU"):
        CudaProbe()


@linux_only
def test_system_probe_counts_the_whole_resident_set_mapped_files_included(tmp_path: Path) -> None:
    probe = SystemProbe()
    assert probe.available() > 0
    assert probe.limit() >= probe.available()
    # Fresh anonymous pages, each touched: a heap allocation could reuse pages an earlier test freed but left
    # resident (glibc keeps them), and then RSS would not move at all.
    with mmap.mmap(-1, 64 * MB) as block:
        before = probe.rss()
        for offset in range(0, 64 * MB, 4096):
            block[offset] = 1
        assert probe.rss() - before >= 60 * MB

    # Mapped file pages are in the RSS the OS reports (and kills by): --max-memory counts them too (issue 71).
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x02" * (64 * MB))
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        before = probe.rss()
        total = sum(view[offset] for offset in range(0, len(view), 4096))  # touch every page
        assert total == 2 * (64 * MB // 4096)
        assert probe.rss() - before >= 60 * MB
    peak = os_peak_rss()
    assert peak is not None and peak >= 64 * MB


def test_the_os_peak_is_the_merges_own_when_a_large_process_started_it() -> None:
    # ru_maxrss survives exec: a merge run by subprocess from a notebook kernel holding a model reported the
    # kernel's size as its own peak RAM (in status and the ledger). The peak read is the process's own.
    ballast = bytearray(600 * MB)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # resident, not just reserved
    code = "from resumerge.machine.memory import os_peak_rss; print(os_peak_rss())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    del ballast
    assert int(done.stdout) < 400 * MB


# The child runs 3 rounds of one ``unit``-byte allocation on each of 6 threads, each held briefly, either
# admitted by a governor or not at all; it reports how many ran concurrently at most.
CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    from resumerge.machine.memory import MemoryGovernor, Pacing, SystemProbe
    budget, unit, governed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    governor = MemoryGovernor(budget, SystemProbe(), pacing=Pacing(sample_interval=0.01))
    lock, running, most = threading.Lock(), [0], [0]
    # Ungoverned, all six units provably coexist; governed, a barrier would wait for units never admitted.
    together = None if governed else threading.Barrier(6, timeout=30)

    def one_unit():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        block = b"\\x01" * unit  # written, so every page is resident
        if together is not None:
            together.wait()
        time.sleep(0.05)
        del block
        with lock:
            running[0] -= 1

    def worker():
        for _ in range(3):
            if governed:
                with governor.acquire(unit, timeout=30):
                    one_unit()
            else:
                one_unit()

    with governor:
        threads = [threading.Thread(target=worker) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    print(json.dumps({"most_in_flight": most[0], "adaptations": len(governor.adaptations)}))
    """
)

# A launcher of its own, so RUSAGE_CHILDREN covers exactly one child and no other test's subprocess.
LAUNCHER = textwrap.dedent(
    """
    import json, resource, subprocess, sys
    out = subprocess.run(sys.argv[1:], check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    report["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps(report))
    """
)


def run_child(budget: int, unit: int, governed: bool) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = [sys.executable, "-c", LAUNCHER, sys.executable, "-c", CHILD, str(budget), str(unit), str(int(governed))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=True)
    report: dict[str, int] = json.loads(done.stdout)
    return report


@linux_only
def test_a_real_process_stays_under_its_budget() -> None:
    budget, unit = 160 * MB, 40 * MB
    free = run_child(budget, unit, governed=False)
    assert free["peak_rss"] > budget  # without the governor, 6 × 40 MB at once breaks the budget
    governed = run_child(budget, unit, governed=True)
    assert governed["peak_rss"] <= budget, governed
    assert governed["most_in_flight"] >= 2  # it still runs units side by side when they fit
