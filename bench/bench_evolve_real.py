"""Issue 68's real-weights search, bigger than its test: SmolLM2-135M-Instruct and the suite's two fine-tunes of it
(weather bulletins, recipes; ``tests/realmodel.py``'s cached fixture), a ``task_arithmetic`` (or ``ties``) genome
searched by ``kl`` tasks (each fine-tune on its own training texts), then the best merge, the method's
default-parameter merge (the search's first candidate) and the uniform linear merge scored on each domain's held-out
texts by the same streamed pass.

Usage::

    PYTHONPATH=TREE python bench/bench_evolve_real.py [--lines 12] [--granularity 15] [--popsize 4]
        [--generations 4] [--seed 1] [--method task_arithmetic|ties] [--normalize default|true|false]

Prints the objective per generation (best, median, worst of the generation and the best so far), the three merges'
objective and held-out KL per domain, the wall time and the load (``os.getloadavg``), as a Markdown block for
``bench/RESULTS.md``. Issue 68's claim is asserted: it exits 1, saying which comparison failed, unless the search's
best merge is below both the default-parameter merge and the uniform linear merge on the objective and on each
domain's held-out KL (all three scored by the same pass; a search too long for a test, so the bench holds it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    from realmodel import smollm2_finetunes

    from resumerge import api
    from resumerge.runs.evolve.search import SearchOptions
    from tests.evolve.realsearch import baselines, held_out_tasks, objective_of, planned_of, scored, write_search

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=12)
    parser.add_argument("--granularity", type=int, default=15)
    parser.add_argument("--popsize", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--method", choices=("task_arithmetic", "ties"), default="task_arithmetic")
    parser.add_argument("--normalize", choices=("default", "true", "false"), default="default")
    args = parser.parse_args()
    started = time.monotonic()
    base, weather, recipes = smollm2_finetunes()
    fixture = time.monotonic() - started
    root = Path(tempfile.gettempdir()) / f"bench-evolve-real-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    config = write_search(root, base, [weather, recipes], lines=args.lines, granularity=args.granularity,
                          method=args.method, normalize=None if args.normalize == "default" else
                          args.normalize == "true")
    max_fevals = args.popsize * args.generations  # whole generations: the search stops at exactly max_fevals
    started = time.monotonic()
    outcome = api.evolve(config, root / "store", search=api.Search(max_fevals=max_fevals, popsize=args.popsize,
                                                                   random_seed=args.seed))
    searching = time.monotonic() - started
    rows = [json.loads(line) for line in (root / "store" / "evaluations.jsonl").read_text().splitlines()]
    planned = planned_of(config, SearchOptions(max_fevals, args.popsize, 1 / 6, args.seed))
    tasks = (*planned.spec.tasks, *held_out_tasks([weather, recipes]))
    started = time.monotonic()
    figures = scored(root / "held-out", tasks, {"best": outcome.best.config, **baselines(planned)}, base)
    holding = time.monotonic() - started
    names = [t.name for t in tasks]
    print(f"### Real-weights evolve search (SmolLM2-135M-Instruct, {args.method}, normalize {args.normalize}, "
          f"layer_granularity {args.granularity}, "
          f"popsize {args.popsize}, {outcome.generations} generations, {args.lines} lines per kl task, "
          f"seed {args.seed})\n")
    print("| generation | best | median | worst | best so far |\n|---|---|---|---|---|")
    so_far = float("inf")
    for generation in sorted({r["generation"] for r in rows}):
        values = [r["objective"] for r in rows if r["generation"] == generation]
        so_far = min(so_far, *values)
        print(f"| {generation} | {min(values):.4f} | {statistics.median(values):.4f} | {max(values):.4f} | "
              f"{so_far:.4f} |")
    print("\n| merge | objective | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for merge, found in figures.items():
        print(f"| {merge} | {objective_of(planned, found):.4f} | "
              + " | ".join(f"{found[n]:.4f}" for n in names) + " |")
    print(f"\nbest: generation {outcome.best.generation} candidate {outcome.best.number}, genotype "
          f"{[round(v, 3) for v in outcome.best.genotype]}")
    print(f"wall: fixture {fixture:.0f} s (cached: ~0), search {searching:.0f} s, held-out scoring {holding:.0f} s; "
          f"load {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    shutil.rmtree(root, ignore_errors=True)
    failed = unmet(figures, objective_of(planned, figures["best"]),
                   {m: objective_of(planned, figures[m]) for m in ("default", "linear")},
                   [t.name for t in tasks[len(planned.spec.tasks):]])
    for line in failed:
        print(f"CLAIM FAILS: {line}")
    if failed:
        sys.exit(1)
    print("claim holds: the best merge beats the default-parameter and the linear merge on the objective and on "
          "each domain's held-out texts")


def unmet(figures: dict[str, dict[str, float]], best: float, others: dict[str, float],
          held_out: list[str]) -> list[str]:
    """Each comparison of issue 68's claim the search's best merge loses (or ties): its objective against each
    other merge's, then each held-out figure (lower is better everywhere)."""
    failed = [f"objective {best:.4f} is not below {merge}'s {value:.4f}" for merge, value in others.items()
              if not best < value]
    failed += [f"{name} {figures['best'][name]:.4f} is not below {merge}'s {figures[merge][name]:.4f}"
               for merge in others for name in held_out if not figures["best"][name] < figures[merge][name]]
    return failed


if __name__ == "__main__":
    main()
