"""Count where resumerge's rank-based methods differ from mergekit 0.1.5, and check every difference is a tie.

Usage::

    python bench/tie_parity.py [--shape 1024x4096] [--dtypes float32,bfloat16,float16] [--seed 0]

Inputs look like a real fine-tune: a base ~ N(0, 0.02²) and two fine-tunes about 10 % away from it, cast to each
dtype. For ties, breadcrumbs, breadcrumbs_ties and sce (``select_topk`` 0.5) the script compares the method's
output with mergekit's (its in-memory ``merge_tensors``): the number of differing elements, how many positions
hold a threshold tie (equal ranked values straddling a kept window, ``tests/methods/tieparity.py``), whether
every difference lies on one, the largest difference elsewhere relative to the tensor's largest magnitude
(non-zero only when a tie feeds a whole-tensor quantity, as SCE's energy weights), and whether the output is
bit-identical to mergekit's once mergekit's sorts are made stable. DELLA's differences are a matter of ranks,
not thresholds, so its masks are compared directly (``sparsify.della_magprune`` against mergekit's, seeded
alike, no rescale): differing keep decisions and positions whose magnitude is shared with another in its row.
Needs mergekit 0.1.5; prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from methods.tieparity import make_sorts_stable, row_ties, threshold_ties  # noqa: E402

from resumerge.merge.methods import MergeContext, get_method, sparsify  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PER_MODEL = {"weight": [None, 0.6, 0.4], "density": [None, 0.5, 0.5], "gamma": [None, 0.01, 0.01]}
CASES: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {
    "ties": ({}, {k: PER_MODEL[k] for k in ("weight", "density")}),
    "breadcrumbs": ({}, PER_MODEL),
    "breadcrumbs_ties": ({}, PER_MODEL),
    "sce": ({"select_topk": 0.5}, {}),
}


@contextmanager
def stable_sorts() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    try:
        make_sorts_stable(patch)
        yield
    finally:
        patch.undo()


def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = 0.02 * torch.randn(shape, generator=gen)
    return [base.to(dtype)] + [(base + 0.002 * torch.randn(shape, generator=gen)).to(dtype) for _ in range(2)]


def ours(method: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    spec = get_method(method)
    assert spec is not None
    params, per_model = CASES[method]
    model_params = [{k: v[i] for k, v in per_model.items() if v[i] is not None} for i in range(len(tensors))]
    return spec.fn(MergeContext(tensors, 0, *spec.bind(model_params, params, 0), torch.Generator()))


def theirs(method: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    from mergekit.merge_methods import merge_tensors

    params, per_model = CASES[method]
    parameters: dict[str, Any] = dict(params)
    for name, values in per_model.items():
        parameters[name] = {i: v for i, v in enumerate(values) if v is not None}
    result: torch.Tensor = merge_tensors(list(tensors), method, parameters=parameters, base_index=0)
    return result


def off_tie_gap(mine: torch.Tensor, plain: torch.Tensor, ties: torch.Tensor) -> float:
    """The largest difference away from tie positions, relative to mergekit's largest magnitude.

    Non-zero only where a tie changes a whole-tensor quantity (SCE's energy weights, an L1 rescale).
    """
    a, b = mine[~ties].double(), plain[~ties].double()
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / plain.double().abs().max())


def della_row(delta: torch.Tensor, seed: int) -> tuple[int, int, int, bool]:
    """(elements, row-tied positions, differing keep decisions, all differences on row ties) for one delta."""
    from mergekit import sparsify as mergekit_sparsify

    kept = sparsify.sample(delta, sparsify.Sampled(0.5, 0.1), rescale=False,
                           generator=torch.Generator().manual_seed(seed))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        kept_theirs = mergekit_sparsify.della_magprune(delta, 0.5, 0.1)
    ties = row_ties(delta.abs())
    differ = (kept != 0) != (kept_theirs != 0)
    return delta.numel(), int(ties.sum()), int(differ.sum()), bool((ties | ~differ).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1024x4096")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split("x"))
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        tensors = inputs(shape, dtype, args.seed)
        for method in CASES:
            mine = ours(method, tensors)
            plain = theirs(method, tensors)
            with stable_sorts():
                stable = theirs(method, tensors)
            params, per_model = CASES[method]
            ties = threshold_ties(method, tensors, 0, params, per_model)
            differ = mine != plain
            rows.append(
                (
                    method,
                    dtype_name,
                    mine.numel(),
                    int(ties.sum()),
                    int(differ.sum()),
                    bool((ties | ~differ).all()),
                    off_tie_gap(mine, plain, ties),
                    torch.equal(mine, stable),
                )
            )
            print(*rows[-1], flush=True)
        n, tied, differing, on_ties = della_row(tensors[1] - tensors[0], args.seed)
        rows.append(("della (masks)", dtype_name, n, tied, differing, on_ties, 0.0, None))
        print(*rows[-1], flush=True)
    print()
    print(f"Inputs: base ~ N(0, 0.02²), fine-tunes ± N(0, 0.002²), shape {args.shape}, seed {args.seed}.")
    print(f"Command: `python bench/tie_parity.py {' '.join(sys.argv[1:])}`")
    print()
    print(
        "| method | dtype | elements | tie positions | differ from mergekit | all on ties | worst off-tie gap "
        "| = mergekit with stable sorts |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for method, dtype_name, n, tied, differing, on_ties, gap, stable_equal in rows:
        stable_text = "—" if stable_equal is None else ("yes" if stable_equal else "NO")
        print(
            f"| {method} | {dtype_name} | {n} | {tied} | {differing} | {'yes' if on_ties else 'NO'} | {gap:.1e} "
            f"| {stable_text} |"
        )


if __name__ == "__main__":
    main()
