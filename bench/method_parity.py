"""Compare every resumerge merge method with mergekit 0.1.5 on the same random tensors.

Usage::

    python bench/method_parity.py [--rows 256] [--cols 384] [--seed 0]

Prints a markdown table "method | dtype | worst abs diff | worst rel diff | bit-identical" over a 2-D tensor
of the given shape and a 1-D tensor of ``cols`` elements per method and dtype. mergekit is called through its
own in-memory API (``mergekit.merge_methods.merge_tensors``). The randomized methods (``dare_*``, ``della*``,
``arcee_fusion`` above 1M elements) are run with mergekit's global RNG and resumerge's generator seeded
alike, which draws the same masks on CPU as long as both consume the stream in the same order. The relative
difference is ``max|ours − theirs| / max|theirs|`` over the tensor (a norm-wise measure, so values near zero do
not dominate). Needs mergekit 0.1.5 installed; never imported by resumerge itself.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from methods.footprint_cases import Case

from resumerge.merge.methods import MergeContext, get_method

W = [None, 0.3, 0.5, 0.2]  # per-model weights; the base (input 0) takes none
D = [None, 0.5, 0.6, 0.3]  # densities

CASES = (
    Case("linear", 3, None, {}, {"weight": [0.3, 0.5, 0.2]}),
    Case("slerp", 2, 0, {"t": 0.3}),
    Case("nuslerp", 3, 0, {}, {"weight": [None, 0.4, 0.6]}),
    Case("multislerp", 4, 0, {}, {"weight": W}),
    Case("karcher", 3, None),
    Case("task_arithmetic", 4, 0, {"lambda": 0.9}, {"weight": W}),
    Case("ties", 4, 0, {}, {"weight": W, "density": D}),
    Case("dare_ties", 4, 0, {}, {"weight": W, "density": D}),
    Case("dare_linear", 4, 0, {}, {"weight": W, "density": D}),
    Case("breadcrumbs", 4, 0, {}, {"weight": W, "density": D, "gamma": [None, 0.05, 0.02, 0.1]}),
    Case("breadcrumbs_ties", 4, 0, {}, {"weight": W, "density": D, "gamma": [None, 0.05, 0.02, 0.1]}),
    Case("della", 4, 0, {}, {"weight": W, "density": D, "epsilon": [None, 0.1, 0.2, 0.15]}),
    Case("della_linear", 4, 0, {}, {"weight": W, "density": D, "epsilon": [None, 0.1, 0.2, 0.15]}),
    Case("sce", 4, 0, {"select_topk": 0.5}),
    Case("ram", 4, 0, {"epsilon": 1e-5}),
    Case("ramplus_tl", 4, 0, {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}),
    Case("model_stock", 4, 0),
    Case("nearswap", 2, 0, {"t": 0.05}),
    Case("arcee_fusion", 2, 0),
    Case("passthrough", 1, None, {}, {"scale": [0.5]}),
)


def make_inputs(case: Case, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Base ~ N(0, 1); every other input = base + 0.1·N(0, 1) on a random 70 % of positions (so RAM sees
    untouched positions and TIES sees exact-zero deltas)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    tensors = []
    for i in range(case.inputs):
        if i == case.base:
            tensors.append(base)
            continue
        keep = torch.rand(shape, generator=gen) < 0.7
        tensors.append(base + 0.1 * torch.randn(shape, generator=gen) * keep)
    return [t.to(dtype) for t in tensors]


def model_params(case: Case) -> list[dict[str, Any]]:
    """resumerge's per-input parameter mappings for ``case`` (a None value is left out)."""
    return [
        {name: values[i] for name, values in case.per_model.items() if values[i] is not None}
        for i in range(case.inputs)
    ]


def run_resumerge(case: Case, tensors: list[torch.Tensor], seed: int) -> torch.Tensor:
    """Call the registered resumerge method on ``tensors`` (a generator seeded with ``seed`` if randomized)."""
    spec = get_method(case.method)
    assert spec is not None, case.method
    generator = torch.Generator().manual_seed(seed) if spec.randomized else None
    ctx = MergeContext(tensors, case.base, *spec.bind(model_params(case), case.params, case.base), generator)
    return spec.fn(ctx)


def run_mergekit(case: Case, tensors: list[torch.Tensor], seed: int) -> torch.Tensor:
    """Call mergekit 0.1.5's ``merge_tensors`` with the global RNG seeded with ``seed`` (then restored)."""
    from mergekit.merge_methods import merge_tensors

    parameters: dict[str, Any] = dict(case.params)
    for name, values in case.per_model.items():
        parameters[name] = {i: v for i, v in enumerate(values) if v is not None}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return merge_tensors(tensors, case.method, parameters=parameters, base_index=case.base)


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float, bool]:
    """Return (max abs diff, max abs diff / max |theirs|, bitwise equal); raises on shape or dtype mismatch."""
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        raise AssertionError(f"shape/dtype differ: {ours.shape}/{ours.dtype} vs {theirs.shape}/{theirs.dtype}")
    diff = (ours.double() - theirs.double()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    scale = float(theirs.double().abs().max()) if theirs.numel() else 0.0
    return worst, (worst / scale if scale else worst), bool(torch.equal(ours, theirs))


def main(argv: Sequence[str] | None = None) -> None:
    """Print the parity table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = [(args.rows, args.cols), (args.cols,)]
    print("| method | dtype | worst abs diff | worst rel diff | bit-identical |")
    print("|---|---|---|---|---|")
    for case in CASES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            worst_abs = worst_rel = 0.0
            identical = True
            for n, shape in enumerate(shapes):
                tensors = make_inputs(case, shape, dtype, args.seed + n)
                ours = run_resumerge(case, tensors, args.seed + 100 + n)
                theirs = run_mergekit(case, tensors, args.seed + 100 + n)
                a, r, same = compare(ours, theirs)
                worst_abs, worst_rel, identical = max(worst_abs, a), max(worst_rel, r), identical and same
            name = str(dtype).removeprefix("torch.")
            print(f"| {case.method} | {name} | {worst_abs:.3g} | {worst_rel:.3g} | {'yes' if identical else 'no'} |")


if __name__ == "__main__":
    main()
