"""An evaluation's process, start to end: wall and CPU of ``resumerge eval`` for two checkouts of resumerge side by
side, alternated, on the tests' tiny model and on SmolLM2-135M-Instruct (tests/realmodel.py), a multiple-choice task
with local data (tests/evaluation/evaltasks.py), each with a fresh state dir; and whether both print the same
results (``--json``, less its clock and environment fields).

Usage::

    python bench/bench_eval_start.py A_ROOT B_ROOT [--pairs 3] [--work DIR] [--limit 2]

CPU is the whole process tree's (this script is a child subreaper: see bench_moe_start.py). Prints one JSON line
per command and the means per model and code, with ``os.getloadavg()`` at each start (it counts other sessions'
niced work too).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
from pathlib import Path

from childtime import ab_parser, timed_run, tree_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

_PR_SET_CHILD_SUBREAPER = 36
# what differs between two runs of the same evaluation
_CLOCK = ("date", "start_time", "end_time", "total_evaluation_time_seconds", "git_hash", "pretty_env_info",
          "transformers_version", "lm_eval_version", "upper_git_hash")


def timed(argv: list[str], root: str) -> tuple[dict[str, object], str]:
    """Run ``argv`` with ``root``'s resumerge: wall, tree CPU, load; and its output."""
    load = os.getloadavg()
    wall, cpu, out = timed_run(argv, tree_env(root), reaped=True)
    return {"wall": round(wall, 2), "cpu": round(cpu, 2), "load": [round(x, 1) for x in load]}, out


def _results(stdout: str) -> object:
    doc = json.loads(stdout)
    return {k: v for k, v in doc.items() if k not in _CLOCK}


def main() -> None:
    parser = ab_parser(__doc__, "bench-eval-start")
    parser.add_argument("--limit", type=int, default=2)
    args = parser.parse_args()
    from realmodel import smollm2_folder

    from tests.evaluation.evaltasks import tiny_model, write_tasks

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    args.work.mkdir(parents=True, exist_ok=True)
    tiny = args.work / "tiny"
    if not (tiny / "config.json").is_file():
        tiny_model(tiny)
    for made in ("data", "tasks"):  # write_tasks makes them
        shutil.rmtree(args.work / made, ignore_errors=True)
    tasks = write_tasks(args.work)
    models = {"tiny": tiny, "smollm2": smollm2_folder()}
    rows: list[dict[str, object]] = []
    seen: dict[str, object] = {}
    for pair in range(args.pairs):
        order = [("A", args.a_root), ("B", args.b_root)]
        for code, root in order if pair % 2 == 0 else order[::-1]:
            for name, model in models.items():
                state = args.work / f"state-{code}"
                shutil.rmtree(state, ignore_errors=True)
                row, out = timed([sys.executable, "-P", "-m", "resumerge", "eval", str(model), "--tasks", "tiny_mc",
                                  "--include-path", str(tasks), "--limit", str(args.limit), "--state-dir",
                                  str(state), "--json"], root)
                results = _results(out)
                same = seen.setdefault(name, results) == results
                row = {"pair": pair + 1, "code": code, "model": name, **row, "same_results": same}
                print(json.dumps(row), flush=True)
                rows.append(row)
                shutil.rmtree(state)
    for name in models:
        for code in ("A", "B"):
            got = [r for r in rows if r["model"] == name and r["code"] == code]
            wall = sum(float(str(r["wall"])) for r in got) / len(got)
            cpu = sum(float(str(r["cpu"])) for r in got) / len(got)
            print(f"{name:8} {code}: wall {wall:.2f} s, CPU {cpu:.2f} s (mean of {len(got)})")


if __name__ == "__main__":
    main()
