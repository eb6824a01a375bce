"""``resumerge status`` of a finished output and ``resumerge plan`` of its config, trees alternated (issue 72).

Usage::

    python bench/status_plan_costs.py --config CFG --out OUT --state-dir STATE --tree A [--tree B]
        [--status-runs 15] [--plan-runs 2] [--tensors 90003]

Each command runs in a fresh process (``python -P -m resumerge``, the tree on ``PYTHONPATH``, from a neutral
working directory), the trees alternated pair by pair (A B, B A, ...): ``status OUT --state-dir STATE`` (the table)
and ``status ... --json`` ``--status-runs`` times each, ``python -P -c pass`` beside them (the interpreter and this
machine's site hooks, which every command pays), then ``plan CFG NEW_OUT --json`` with a fresh state dir
``--plan-runs`` times. Reported: wall and user+system CPU seconds of the process and its children (``plan``'s
helper), median (min-max) per tree, ``plan``'s CPU per tensor, and the load average beside each series. Build the
90k-tensor output first with ``tests/manylayers.py`` (``bench/bench_many_tensors.py`` does) and its ``run``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from childtime import timed_run, tree_env


def timed(argv: list[str], tree: Path | None, cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, waited-for descendants included) of one process."""
    wall, cpu, _ = timed_run(argv, tree_env(tree), cwd=cwd)
    return wall, cpu


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--tree", type=Path, action="append", required=True)
    parser.add_argument("--status-runs", type=int, default=15)
    parser.add_argument("--plan-runs", type=int, default=2)
    parser.add_argument("--tensors", type=int, default=90_003)
    args = parser.parse_args()
    cwd = Path(tempfile.mkdtemp(prefix="status-plan-costs-"))
    py = [sys.executable, "-P"]
    series = {
        "status (table)": ["-m", "resumerge", "status", str(args.out), "--state-dir", str(args.state_dir)],
        "status --json": ["-m", "resumerge", "status", str(args.out), "--state-dir", str(args.state_dir), "--json"],
    }
    for label, tail in series.items():
        got: dict[Path, list[tuple[float, float]]] = {t: [] for t in args.tree}
        bare: list[float] = []
        loads = [os.getloadavg()[0]]
        for run in range(args.status_runs):
            for tree in args.tree if run % 2 == 0 else args.tree[::-1]:
                got[tree].append(timed([*py, *tail], tree, cwd))
            bare.append(timed([*py, "-c", "pass"], None, cwd)[1])
        loads.append(os.getloadavg()[0])
        print(f"{label}, {args.status_runs} alternated runs, load {loads[0]:.2f} -> {loads[1]:.2f}:")
        for tree, pairs in got.items():
            print(f"  {tree}: wall {summary([w for w, _ in pairs])} s, CPU {summary([c for _, c in pairs])} s")
        print(f"  python -P -c pass: CPU {summary(bare)} s", flush=True)
    for run in range(args.plan_runs):
        for tree in args.tree if run % 2 == 0 else args.tree[::-1]:
            state = cwd / f"plan-state-{run}"
            seen = os.getloadavg()[0]
            wall, cpu = timed([*py, "-m", "resumerge", "plan", str(args.config), str(cwd / f"plan-out-{run}"),
                               "--json", "--state-dir", str(state)], tree, cwd)
            shutil.rmtree(state, ignore_errors=True)
            print(f"plan run {run} {tree}: {wall:.2f} s wall, {cpu:.2f} s CPU, "
                  f"{cpu / args.tensors * 1000:.3f} ms CPU a tensor (load {seen:.2f})", flush=True)
    shutil.rmtree(cwd, ignore_errors=True)


if __name__ == "__main__":
    main()
