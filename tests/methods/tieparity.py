"""Where resumerge differs from mergekit by design: equal values competing for the last places of a ranking.

resumerge orders equal magnitudes (TIES, breadcrumbs, DELLA) and equal variances (SCE) by index, as a stable sort
orders them; mergekit takes whatever torch's unstable sort or ``topk`` returns. These helpers are written against
plain stable ``torch.sort`` calls, independently of :mod:`resumerge.merge.methods.ranking`: they find the positions
where the two may legitimately differ, so that differential tests stay exact everywhere else, and they make
mergekit's sorts stable, after which it must agree with resumerge bit for bit. Small tensors only (they sort).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

# Methods whose deterministic result depends on a ranking, and what each ranks.
RANKED = {"ties": "magnitude", "breadcrumbs": "outliers", "breadcrumbs_ties": "outliers", "sce": "variance"}


def straddling(values: torch.Tensor, start: int, stop: int, *, descending: bool) -> torch.Tensor:
    """Mark the entries equal to a value whose run of equal entries crosses an end of the sorted window.

    The window is positions ``[start, stop)`` of the (stable) sort of the flattened ``values``. Entries of such a
    run may be kept or dropped depending on how a sort orders equal values; every other entry is decided by the
    values alone. Returns a bool tensor of ``values``' shape.
    """
    flat = values.reshape(-1)
    n = flat.numel()
    start, stop = max(0, start), min(n, stop)
    marked = torch.zeros(n, dtype=torch.bool)
    if start >= stop:
        return marked.reshape(values.shape)
    ordered = torch.sort(flat, descending=descending, stable=True).values
    for end in {start, stop - 1}:
        where = torch.nonzero(ordered == ordered[end]).reshape(-1)
        if int(where[0]) < start or int(where[-1]) >= stop:
            marked |= flat == ordered[end]
    return marked.reshape(values.shape)


def threshold_ties(
    method: str,
    tensors: Sequence[torch.Tensor],
    base: int,
    params: Mapping[str, Any],
    per_model: Mapping[str, Sequence[Any]],
) -> torch.Tensor:
    """Positions of the output where ``method`` (a key of :data:`RANKED`) may differ from mergekit by design.

    A position is marked when, for some input, the ranked value there is tied with the value at an end of the
    kept window and its run straddles that end. Parameters follow the ``merge`` fixture's conventions.
    """
    kind = RANKED[method]
    marked = torch.zeros(tensors[base].shape, dtype=torch.bool)
    others = [i for i in range(len(tensors)) if i != base]
    if kind == "variance":
        fraction = float(params.get("select_topk", 1.0))
        if fraction >= 1 or fraction <= 0:
            return marked
        variance = torch.var(torch.stack([tensors[i] - tensors[base] for i in others]), dim=0, unbiased=False)
        keep = int(torch.count_nonzero(variance) * fraction)
        return straddling(variance.abs(), 0, keep, descending=True)
    for i in others:
        density = float(per_model.get("density", [1.0] * len(tensors))[i])
        if density >= 1:
            continue
        magnitudes = (tensors[i] - tensors[base]).abs().float()
        n = magnitudes.numel()
        if kind == "magnitude":
            marked |= straddling(magnitudes, 0, max(1, int(density * n)), descending=True)
        else:
            gamma = float(per_model.get("gamma", [0.01] * len(tensors))[i])
            keep = int(density * n)
            skip = max(0, n - keep - int(gamma * n))
            marked |= straddling(magnitudes, skip, skip + keep, descending=False)
    return marked


def row_ties(values: torch.Tensor) -> torch.Tensor:
    """Mark entries equal to another entry of their row along dim 1 (1-D: the whole tensor), as DELLA ranks."""
    moved = values.reshape(1, -1) if values.dim() < 2 else values.movedim(1, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    ordered, order = torch.sort(rows, dim=1)
    same = ordered[:, 1:] == ordered[:, :-1]
    marked_sorted = torch.zeros_like(rows, dtype=torch.bool)
    marked_sorted[:, 1:] |= same
    marked_sorted[:, :-1] |= same
    marked = torch.empty_like(marked_sorted).scatter_(1, order, marked_sorted).reshape(moved.shape)
    return marked.reshape(values.shape) if values.dim() < 2 else marked.movedim(-1, 1)


def make_sorts_stable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``torch.sort``, ``torch.argsort`` and ``torch.topk`` stable (equal values in index order).

    With these patched, mergekit's rank-based methods follow resumerge's tie rule, so the two must be
    bit-identical even in bfloat16.
    """
    sort = torch.sort

    def stable_sort(
        input: torch.Tensor, dim: int = -1, descending: bool = False, stable: bool = False
    ) -> torch.return_types.sort:
        return sort(input, dim=dim, descending=descending, stable=True)

    def stable_argsort(
        input: torch.Tensor, dim: int = -1, descending: bool = False, stable: bool = False
    ) -> torch.Tensor:
        return sort(input, dim=dim, descending=descending, stable=True).indices

    def stable_topk(
        input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = sort(input, dim=dim, descending=largest, stable=True)
        return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)

    monkeypatch.setattr(torch, "sort", stable_sort)
    monkeypatch.setattr(torch, "argsort", stable_argsort)
    monkeypatch.setattr(torch, "topk", stable_topk)


def mergekit_with_stable_sorts(
    method: str, tensors: Sequence[torch.Tensor], base: int | None, parameters: Mapping[str, Any]
) -> torch.Tensor:
    """Run mergekit 0.1.5's own ``method`` in memory with :func:`make_sorts_stable` in force.

    ``parameters`` are mergekit's (``{name: value}`` globals, ``{name: {input index: value}}`` per model). Needs
    mergekit installed; the patch is undone before returning.
    """
    from mergekit.merge_methods import merge_tensors

    with pytest.MonkeyPatch.context() as patch:
        make_sorts_stable(patch)
        result: torch.Tensor = merge_tensors(list(tensors), method, parameters=dict(parameters), base_index=base)
    return result
