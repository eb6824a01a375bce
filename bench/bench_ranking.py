"""Rank-based methods in isolation: the old full-sort ranking against the selection-based one, per thread count.

Usage::

    python bench/bench_ranking.py [--shapes 4096x4096,32000x2048] [--threads 1,2] [--dtype float32]
        [--methods ties,breadcrumbs,...] [--repeats 3]

For every method, shape and thread count (``torch.set_num_threads``) it times one merge of a base plus two
fine-tunes (one fine-tune for arcee_fusion) through the registered method, first with the ranking this package
used before issue 17 (argsort of every task vector, DELLA's double argsort, ``topk`` for SCE, a full sort for
arcee_fusion's quantiles, and the task-vector pipeline with its full-size temporaries; re-created below and
swapped in for the run) and then with the current one. Each figure is the fastest of ``--repeats`` calls after
one warm-up call, with the least CPU time of the calls (all threads: about the wall time when one core did the
work, twice it when both did; less disturbed than wall time when other jobs share the machine). "identical"
compares the two outputs bit for bit; they differ only where equal magnitudes straddle a threshold (see
``bench/tie_parity.py``), which realistic float32 task vectors have a few of. Ends with a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from resumerge.methods import MergeContext, arcee_fusion, get_method, sce, sce_steps, sparsify, task_arithmetic  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# method -> (global params, per-model params of each fine-tune)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ties": ({}, {"weight": 0.5, "density": 0.5}),
    "breadcrumbs": ({}, {"weight": 0.5, "density": 0.5, "gamma": 0.01}),
    "breadcrumbs_ties": ({}, {"weight": 0.5, "density": 0.5, "gamma": 0.01}),
    "della": ({}, {"weight": 0.5, "density": 0.5, "epsilon": 0.1}),
    "della_linear": ({}, {"weight": 0.5, "density": 0.5, "epsilon": 0.1}),
    "sce": ({"select_topk": 0.5}, {}),
    "arcee_fusion": ({}, {}),
    "dare_ties": ({}, {"weight": 0.5, "density": 0.5}),
}


# --- the ranking before issue 17, kept here only to measure against -------------------------------------------


def _old_magnitude(delta: torch.Tensor, density: float, *, rescale: bool, inplace: bool = False) -> torch.Tensor:
    if density >= 1:
        return delta
    if density <= 0 or delta.numel() == 0:
        return torch.zeros_like(delta)
    keep = max(1, int(density * delta.numel()))
    order = torch.argsort(delta.abs().reshape(-1).float(), descending=True)
    mask = torch.zeros(delta.numel(), dtype=delta.dtype, device=delta.device)
    mask[order[:keep]] = 1
    return sparsify._mask_and_rescale(delta, mask.reshape_as(delta), rescale)


def _old_outliers(
    delta: torch.Tensor, density: float, gamma: float, *, rescale: bool, inplace: bool = False
) -> torch.Tensor:
    if density >= 1:
        return delta
    total = delta.numel()
    keep = int(density * total)
    skip_small = max(0, total - keep - int(gamma * total))
    order = torch.sort(delta.abs().reshape(-1).float(), descending=False).indices
    mask = torch.zeros(total, dtype=delta.dtype, device=delta.device)
    mask[order[skip_small : skip_small + keep]] = 1
    return sparsify._mask_and_rescale(delta, mask.reshape_as(delta), rescale)


def _old_della(
    delta: torch.Tensor,
    density: float,
    epsilon: float,
    *,
    rescale: bool,
    generator: torch.Generator | None,
    inplace: bool = False,
) -> torch.Tensor:
    assert generator is not None and 0 < density < 1
    shape = delta.shape
    rows = delta.reshape(1, -1) if delta.dim() < 2 else delta
    draw = sparsify._draw_dtype(delta.dtype)
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1), dim=1).to(draw) + 1
    low = ranks.min(dim=1, keepdim=True).values
    high = ranks.max(dim=1, keepdim=True).values
    spread = ((ranks - low) / (high - low)).clamp(0, 1)
    probabilities = (density - epsilon) + spread * 2 * epsilon
    work = sparsify._rescale_dtype(delta.dtype)
    mask = torch.bernoulli(probabilities, generator=generator).to(work)
    return sparsify._mask_and_rescale(rows.to(work), mask, rescale).to(delta.dtype).reshape(shape)


def _old_variance_mask(task_vectors: torch.Tensor, fraction: float, dtype: torch.dtype) -> torch.Tensor:
    variance = torch.var(task_vectors, dim=0, unbiased=False)
    keep = int(torch.count_nonzero(variance) * fraction)
    mask = torch.zeros_like(variance, dtype=dtype)
    _, indices = torch.topk(variance.abs().view(-1), k=keep, largest=True)
    mask.view(-1)[indices] = 1
    return mask


def _old_threshold(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flat = scores.reshape(-1)
    if flat.numel() > arcee_fusion.QUANTILE_SAMPLE_SIZE:
        picks = torch.randint(flat.numel(), (arcee_fusion.QUANTILE_SAMPLE_SIZE,), generator=generator)
        flat = flat[picks]
    ordered = torch.sort(flat).values
    positions = (torch.tensor([0.25, 0.5, 0.75]) * (ordered.numel() - 1)).long()
    q1, median, q3 = ordered[positions].unbind()
    return median + 1.5 * (q3 - q1)


def _old_sign_consensus_mask(deltas: torch.Tensor, *, int8: bool = False) -> torch.Tensor:
    sign_dtype = torch.int8 if int8 else deltas.dtype
    signs = deltas.sign().to(sign_dtype)
    elected = (deltas.sum(dim=0) >= 0).to(sign_dtype) * 2 - 1
    return signs == elected


def _old_sign_consensus_weights(deltas: torch.Tensor) -> torch.Tensor:
    return _old_sign_consensus_mask(deltas).to(deltas.dtype)


def _old_population_variance(stacked: torch.Tensor) -> torch.Tensor:
    return torch.var(stacked, dim=0, unbiased=False)


def _old_merge_task_vectors(
    ctx: MergeContext,
    *,
    sparsifier: task_arithmetic.Sparsifier | None,
    consensus: bool,
) -> torch.Tensor:
    base = ctx.base
    others = ctx.others()
    rescale = bool(ctx.params["rescale"])
    deltas = base.new_empty((len(others), *base.shape))
    for slot, index in enumerate(others):
        delta = ctx.tensors[index] - base
        if sparsifier is not None:
            delta = sparsifier(delta, ctx.model_params[index], rescale, ctx.generator)
        deltas[slot] = delta
        del delta
    weights = torch.tensor(
        [float(ctx.model_params[i]["weight"]) for i in others], dtype=deltas.dtype, device=deltas.device
    ).reshape((len(others),) + (1,) * base.dim())
    deltas.mul_(weights)
    if consensus:
        mask = _old_sign_consensus_mask(deltas, int8=bool(ctx.params.get("int8_mask", False)))
        mixed = (deltas * mask).sum(dim=0)
        divisor = (weights * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(dim=0)
        divisor = weights.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    del deltas
    if ctx.params["normalize"]:
        mixed /= divisor
    scale = float(ctx.params.get("lambda", 1.0))
    if scale != 1:
        mixed *= scale
    return (base + mixed).to(base.dtype)


@contextlib.contextmanager
def old_ranking() -> Iterator[None]:
    """Swap the pre-issue-17 ranking (and the task-vector pipeline around it) into the modules for the duration."""
    swaps: list[tuple[object, str, object]] = [
        (sparsify, "magnitude", _old_magnitude),
        (sparsify, "magnitude_outliers", _old_outliers),
        (sparsify, "della_magprune", _old_della),
        (sce, "variance_mask", _old_variance_mask),
        (sce_steps, "sign_consensus_weights", _old_sign_consensus_weights),
        (sce_steps, "population_variance", _old_population_variance),
        (arcee_fusion, "threshold", _old_threshold),
        (task_arithmetic, "merge_task_vectors", _old_merge_task_vectors),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, replacement in swaps:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


# --- measuring --------------------------------------------------------------------------------------------------


def inputs(shape: tuple[int, ...], count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """A base ~ N(0, 0.02²) and ``count`` fine-tunes about 10 % away from it, like real fine-tunes."""
    gen = torch.Generator().manual_seed(0)
    base = 0.02 * torch.randn(shape, generator=gen)
    return [base.to(dtype)] + [(base + 0.002 * torch.randn(shape, generator=gen)).to(dtype) for _ in range(count)]


def call(method: str, tensors: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    spec = get_method(method)
    assert spec is not None
    params, per_model = CASES[method]
    model_params, params = spec.bind([{}] + [dict(per_model) for _ in tensors[1:]], params, 0)

    def run() -> torch.Tensor:
        ctx = MergeContext(tensors, 0, model_params, params, torch.Generator().manual_seed(1))
        return spec.fn(ctx)

    return run


def fastest(run: Callable[[], torch.Tensor], repeats: int) -> tuple[float, float, torch.Tensor]:
    """(fastest wall seconds, least CPU seconds, the result) over ``repeats`` calls after a warm-up call.

    CPU seconds are this process's (all threads): less disturbed than wall time when other jobs share the
    machine, and over wall time about 1 when one core did the work, about 2 when both did.
    """
    result = run()  # warm-up: first-touch page faults and lazy initialisation
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = run()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x4096,32000x2048")
    parser.add_argument("--threads", default="1,2", help="torch.set_num_threads values [default: 1,2]")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--methods", default=",".join(CASES), help=f"comma list from {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per figure (fastest kept)")
    parser.add_argument("--old-repeats", type=int, default=1, help="timed calls of the old ranking")
    args = parser.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in CASES]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}")
    rows = []
    for shape in shapes:
        for method in methods:
            tensors = inputs(shape, 1 if method == "arcee_fusion" else 2, DTYPES[args.dtype])
            for count in threads:
                torch.set_num_threads(count)
                with old_ranking():
                    old, old_cpu, old_out = fastest(call(method, tensors), args.old_repeats)
                new, new_cpu, new_out = fastest(call(method, tensors), args.repeats)
                same = torch.equal(old_out, new_out)
                del old_out, new_out
                label = "x".join(map(str, shape))
                print(
                    f"{method:17s} {label:11s} threads {count}: old {old:7.3f} s (cpu {old_cpu:7.3f})  "
                    f"new {new:7.3f} s (cpu {new_cpu:7.3f})  {old / new:5.1f}x  identical: {same}",
                    flush=True,
                )
                rows.append((method, label, count, old, old_cpu, new, new_cpu, same))
    print()
    print(f"torch {torch.__version__}, dtype {args.dtype}, fastest of {args.repeats} (old: {args.old_repeats})")
    print(f"Command: `python bench/bench_ranking.py {' '.join(sys.argv[1:])}`")
    print()
    print(
        "| method | shape | threads | old wall s | old CPU s | new wall s | new CPU s | speed-up (wall) "
        "| new CPU / wall | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method, label, count, old, old_cpu, new, new_cpu, same in rows:
        print(
            f"| {method} | {label} | {count} | {old:.3f} | {old_cpu:.3f} | {new:.3f} | {new_cpu:.3f} "
            f"| {old / new:.1f}× | {new_cpu / new:.2f} | {same} |"
        )
    gains = [old / new for method, _, _, old, _, new, _, _ in rows if method != "dare_ties"]
    if gains:
        print(f"\nmedian speed-up of the rank-based methods: {statistics.median(gains):.1f}×")


if __name__ == "__main__":
    main()
