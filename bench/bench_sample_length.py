"""Does a shorter speed sample give ``plan`` the same compute time? Paired runs of the sample at several lengths.

Usage::

    python bench/bench_sample_length.py [--budgets 3.0,1.5,1.0] [--pairs 5] [--mtp] [--work DIR]

Plans DeepSeek-V3 x R1 (the sparse real-shape checkpoints of ``tests/sparse_checkpoints.py``, as
``bench_plan_scale.py`` writes them) once, then times its speed sample
(:func:`resumerge.analyses.estimate.compute.measure_compute`, the run's thread count) ``--pairs`` times at each of
``--budgets`` seconds, the lengths alternated within each pair so that a busy spell hits them alike. Prints each
group's fit (ns per element + ms per tensor) and the compute time ``plan`` would print, then, per budget and group,
the spread of its repeats around their median (the goal: within ±20 %), and per shorter budget and group each
pair's ratio of that time to the longest budget's: a shorter sample is as good when every ratio is within ±15 %.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from sparse_checkpoints import DEEPSEEK_V3, write_sparse_checkpoint  # noqa: E402

from resumerge.analyses.estimate.compute import measure_compute  # noqa: E402
from resumerge.config.merge_config import load_config_text  # noqa: E402
from resumerge.merge.engine.executor import CONCURRENCY  # noqa: E402
from resumerge.merge.engine.session import prepare  # noqa: E402
from resumerge.merge.plan.merge_plan import PlanOptions  # noqa: E402

TOLERANCE = 0.15
# Repeated samples of one length should agree this well (issue 45: within ±20 % at load 2).
SPREAD = 0.20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="3.0,1.5,1.0", help="sample lengths in seconds, the first the reference")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--mtp", action="store_true", help="keep DeepSeek-V3's MTP layer 61")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-sample-length"))
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    base = write_sparse_checkpoint(args.work / "deepseek-v3-a", DEEPSEEK_V3, mtp=args.mtp)
    other = args.work / "deepseek-v3-b"
    if not other.exists():
        other.symlink_to(base, target_is_directory=True)
    text = json.dumps({"merge_method": "linear", "models": [
        {"model": str(base), "parameters": {"weight": 0.5}}, {"model": str(other), "parameters": {"weight": 0.5}}]})
    begun = time.perf_counter()
    plan = prepare(load_config_text(text), PlanOptions()).plan
    print(f"planned in {time.perf_counter() - begun:.1f} s")
    seconds: dict[tuple[float, str], list[float]] = {}
    for pair in range(args.pairs):
        for budget in budgets:
            groups = measure_compute(plan, plan.shards, max_seconds=budget, workers=CONCURRENCY)
            fits = []
            for g in groups:
                key = f"{g.method}/{g.dtype}"
                seconds.setdefault((budget, key), []).append(g.seconds or 0.0)
                fits.append(f"{key} {(g.seconds_per_element or 0) * 1e9:.1f} ns + {g.seconds_per_call * 1e3:.1f} ms"
                            f" = {(g.seconds or 0) / 3600:.2f} h (timed {g.measure_seconds:.2f} s)")
            print(f"pair {pair + 1} budget {budget} s, load {os.getloadavg()[0]:.1f}: " + "; ".join(fits))
    for (budget, key), values in sorted(seconds.items()):
        middle = sorted(values)[len(values) // 2]
        spread = [v / middle - 1 if middle else float("inf") for v in values]
        print(f"{budget} s, {key}: {min(values) / 3600:.2f}-{max(values) / 3600:.2f} h over {len(values)} samples, "
              f"{min(spread):+.0%}/{max(spread):+.0%} of their median -> "
              f"{'within' if all(abs(d) <= SPREAD for d in spread) else 'NOT within'} ±{SPREAD:.0%}")
    reference = budgets[0]
    for budget in budgets[1:]:
        for (b, key), values in sorted(seconds.items()):
            if b != budget:
                continue
            ratios = [v / r if r else float("inf") for v, r in zip(values, seconds[(reference, key)], strict=True)]
            same = all(abs(r - 1) <= TOLERANCE for r in ratios)
            print(f"{budget} s against {reference} s, {key}: ratios {', '.join(f'{r:.2f}' for r in ratios)} -> "
                  f"{'same within 15 %' if same else 'NOT the same'}")


if __name__ == "__main__":
    main()
