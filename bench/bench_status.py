"""``resumerge status`` as a user's shell runs it (issue 72: under 0.2 s): the whole process, wall and CPU (user +
system), trees A and B alternated, beside the bare interpreter.

Usage: ``python bench/bench_status.py OUT [--state-dir DIR] --tree A=/path [--tree B=/path] [--pairs 15] [--json]``

Each tree is a checkout (``git archive`` of a commit, or a worktree) put first on ``PYTHONPATH`` of a fresh
``python -P -m resumerge status OUT`` process. Every tree's modules are compiled to ``.pyc`` first, as an installed
package has them (a container with ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile every imported module in
every process). Prints each tree's median (min-max) wall and CPU, the pairwise median of A/B CPU, and ``uptime``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one process: user + system from its rusage."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}: {proc.stderr.read().decode() if proc.stderr else ''}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--state-dir")
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="status OUT --json (the table's rich not imported)")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    for path in trees.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(path) / "resumerge")], check=True,
                       stdout=subprocess.DEVNULL)
    command = ["status", args.out, *(["--state-dir", args.state_dir] if args.state_dir else []),
               *(["--json"] if args.json else [])]
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in [*trees, "bare"]}
    for _ in range(args.pairs):
        for name, path in trees.items():
            env = {**os.environ, "PYTHONPATH": path}
            rows[name].append(_timed([sys.executable, "-P", "-m", "resumerge", *command], env))
        rows["bare"].append(_timed([sys.executable, "-P", "-c", "pass"], dict(os.environ)))
    print(f"status {' '.join(command[1:])}: {args.pairs} rounds, each tree then the bare interpreter")
    for name, got in rows.items():
        walls, cpus = [g[0] for g in got], [g[1] for g in got]
        print(f"  {name:>6}: wall {statistics.median(walls):.3f} ({min(walls):.3f}-{max(walls):.3f}) s, "
              f"CPU {statistics.median(cpus):.3f} ({min(cpus):.3f}-{max(cpus):.3f}) s")
    names = list(trees)
    if len(names) == 2:
        a, b = rows[names[0]], rows[names[1]]
        ratios = [x[1] / y[1] for x, y in zip(a, b)]
        print(f"  {names[0]}/{names[1]} CPU, pairwise median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")
    print("  " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
