"""A merge at the smallest budget ``plan`` names, against the same merge unbounded: wall time and peak RSS (issue 71).

Usage: ``python bench/bench_min_budget.py [--sizes demo,1GB] [--runs N] [--work DIR]``

For each size it generates two Llama-style fp32 models once (``demo``: the ``resumerge demo`` models, 0.9 MB each;
``1GB``: hidden 2048, 4 layers, vocab 16000, 0.98 GB each), asks ``resumerge plan --json`` for the smallest
budget that works, then alternates a linear merge at that budget (``--max-memory`` the named figure) with one at the
default budget. For each run it prints the wall time, the run's peak RSS from ``wait4`` (the OS's, the process's
whole resident set: what ``--max-memory`` counts), that peak over the budget, and the governor's adaptations (from
``resumerge status --json``). A run at the smallest budget must stay within 1.05× of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_linear import CONFIG, run_measured  # noqa: E402  (the same linear config and launcher)

SPECS = {
    "demo": {"layers": 6, "hidden": 64, "intermediate": 128, "vocab": 128, "shard_bytes": 150_000},
    "1GB": {"layers": 4, "hidden": 2048, "intermediate": 5632, "vocab": 16000, "heads": 16, "kv_heads": 4,
            "shard_bytes": 500_000_000},
}


def make_inputs(work: Path, size: str) -> Path:
    """Generate the two input models of ``size`` once (skipped when present); return the config's path."""
    from resumerge.cli.modelgen import ModelSpec, make_model

    root = work / size
    config = root / "merge.yml"
    if not config.exists():
        spec = ModelSpec(**SPECS[size])  # type: ignore[arg-type]
        a = make_model(root / "a", spec, seed=1)
        b = make_model(root / "b", spec, seed=2)
        config.write_text(CONFIG.format(a=a, b=b))
    return config


def smallest_budget(config: Path, out: Path) -> int:
    done = subprocess.run([sys.executable, "-m", "resumerge", "plan", str(config), str(out), "--json",
                           "--probe-size", "0"], capture_output=True, text=True, check=True)
    return int(json.loads(done.stdout)["memory"]["smallest_budget"])


def one_run(config: Path, work: Path, budget: int | None) -> tuple[float, int, int]:
    """(wall, peak RSS, adaptations) of one fresh merge of ``config`` at ``budget`` (None: the default)."""
    out, state = work / "out", work / "state"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    options = [] if budget is None else ["--max-memory", str(budget)]
    wall, peak, code = run_measured([sys.executable, "-m", "resumerge", "run", str(config), str(out), "--quiet",
                                     "--state-dir", str(state), *options])
    if code != 0:  # its stderr's end is printed by run_measured
        sys.exit(f"run failed ({code})")
    status = subprocess.run([sys.executable, "-m", "resumerge", "status", str(out), "--state-dir", str(state),
                             "--json"], capture_output=True, text=True, check=True)
    return wall, peak, int(json.loads(status.stdout)["adaptations"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="demo,1GB", help="comma-separated: demo, 1GB")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/resumerge-bench-min-budget"))
    args = parser.parse_args()
    print("| models | budget | median wall s (each run) | peak RSS MB (each run) | peak / budget | adaptations |")
    print("|---|---|---|---|---|---|")
    over = False
    for size in args.sizes.split(","):
        config = make_inputs(args.work, size)
        smallest = smallest_budget(config, args.work / size / "out")
        results: dict[str, list[tuple[float, int, int]]] = {"smallest": [], "default": []}
        for _ in range(args.runs):  # alternating, so that a change in the machine's load touches both
            results["smallest"].append(one_run(config, args.work / size, smallest))
            results["default"].append(one_run(config, args.work / size, None))
        for name, runs in results.items():
            walls = [w for w, _, _ in runs]
            peaks = [p for _, p, _ in runs]
            label = f"{smallest / 1e6:.0f} MB (smallest named)" if name == "smallest" else "default"
            ratio = f"{max(peaks) / smallest:.2f}×" if name == "smallest" else "—"
            over = over or (name == "smallest" and max(peaks) > 1.05 * smallest)
            print(f"| {size} | {label} | {statistics.median(walls):.2f} ({', '.join(f'{w:.2f}' for w in walls)}) | "
                  f"{' / '.join(f'{p / 1e6:.0f}' for p in peaks)} | {ratio} | "
                  f"{' / '.join(str(a) for _, _, a in runs)} |")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
