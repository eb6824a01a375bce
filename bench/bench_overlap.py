"""Intra-op threads against overlapped units for the compute-bound methods, at the shapes of real tensors.

Usage::

    python bench/bench_overlap.py [--shape 5632x2048] [--methods ties,della,dare_ties] [--rounds 3]

The engine computes units on worker threads (two by default) and torch splits each operation over its intra-op
threads. For each method this times four units of one shape (a base plus two fine-tunes, float32) three ways:
``2 intra × 1 unit`` (``torch.set_num_threads(2)``, units one after another), ``1 intra × 2 units`` (one intra-op
thread, two Python threads each computing half the units at once) and ``2 intra × 2 units`` (both: what the
engine does by default on a 2-core machine). Rounds alternate the three; the table gives median wall seconds per
unit. numpy's selection and row sorts, and the CPU random generator, run on one thread whatever torch's setting,
so only overlapping units puts the second core to work there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from resumerge.merge.methods import MergeContext, get_method  # noqa: E402

PARAMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ties": ({}, {"weight": 0.5, "density": 0.5}),
    "breadcrumbs": ({}, {"weight": 0.5, "density": 0.5, "gamma": 0.01}),
    "della": ({}, {"weight": 0.5, "density": 0.5, "epsilon": 0.1}),
    "dare_ties": ({}, {"weight": 0.5, "density": 0.5}),
    "dare_linear": ({}, {"weight": 0.5, "density": 0.5}),
    "sce": ({"select_topk": 0.5}, {}),
    "karcher": ({}, {}),
}
UNITS = 4


def _inputs(shape: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    base = torch.empty(shape).normal_(0, 0.02, generator=generator)
    return [base] + [torch.empty(shape).normal_(0, 0.002, generator=generator).add_(base) for _ in range(2)]


def _unit(method: str, tensors: list[torch.Tensor]) -> None:
    params, per_model = PARAMS[method]
    spec = get_method(method)
    assert spec is not None
    bound = spec.bind([{}, per_model, per_model], params, 0)
    context = MergeContext(tensors, 0, *bound, torch.Generator().manual_seed(1))
    spec.fn(context)


def _time(method: str, tensors: list[torch.Tensor], intra: int, overlap: int) -> float:
    torch.set_num_threads(intra)
    per_worker = UNITS // overlap

    def work() -> None:
        for _ in range(per_worker):
            _unit(method, tensors)

    start = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(overlap)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return (time.perf_counter() - start) / UNITS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="5632x2048")
    parser.add_argument("--methods", default="ties,della,dare_ties")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shape = tuple(int(part) for part in args.shape.split("x"))
    tensors = _inputs(shape)
    layouts = {"2 intra × 1 unit": (2, 1), "1 intra × 2 units": (1, 2), "2 intra × 2 units": (2, 2)}
    print(f"shape {args.shape} float32, {UNITS} units per timing, {args.rounds} rounds, median s per unit\n")
    print("| method | " + " | ".join(layouts) + " |")
    print("|---|" + "---|" * len(layouts))
    for method in args.methods.split(","):
        _unit(method, tensors)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(args.rounds):
            for name, (intra, overlap) in layouts.items():
                times[name].append(_time(method, tensors, intra, overlap))
        cells = [f"{statistics.median(times[name]):.3f}" for name in layouts]
        print(f"| {method} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
