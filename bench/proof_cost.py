"""What a first run spends on its input proof alone (issue 72): ``InputContents.record`` timed inside one in-process
``resumerge run`` into a fresh OUT and state dir (no records to reuse), wall and process CPU.

Usage: ``PYTHONPATH=CHECKOUT python -P bench/proof_cost.py CONFIG WORK`` — the checkout on ``PYTHONPATH`` decides
which proof runs (a branch's per-range xxh3-128, or main's whole-file sha256): alternate two checkouts by hand, with
``uptime`` beside each figure (bench/bench_first_run.py makes the configs).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from resumerge.cli.commands import main as run_cli
from resumerge.merge.engine import inputcontents


def main() -> None:
    spent: list[tuple[float, float]] = []
    real = inputcontents.InputContents.record

    def timed(self: Any, ledger: Any, notes: list[str]) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        real(self, ledger, notes)
        spent.append((time.perf_counter() - wall, time.process_time() - cpu))

    inputcontents.InputContents.record = timed  # type: ignore[method-assign]
    work = Path(sys.argv[2])
    shutil.rmtree(work, ignore_errors=True)
    try:
        assert run_cli(["run", sys.argv[1], str(work / "out"), "--state-dir", str(work / "state"), "--quiet"]) == 0
        print(f"proof {spent[0][0]:.2f} s wall {spent[0][1]:.2f} s CPU")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
