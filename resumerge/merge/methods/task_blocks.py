"""A rank-window member (``ties``, ``breadcrumbs``, ``breadcrumbs_ties``) merged whole for one of a generation's
candidates straight from what the candidates share — each input's task vector, its magnitude keys and their
histogram — with each window's mask made inside the per-position combine, one block of positions at a time: no
task vector copied per candidate, no whole mask, no selection over the keys.

A window's mask is the keys between its bound keys, less the occurrences of a bound key's straddling run that sort
outside it (:mod:`resumerge.merge.methods.rankstream`). For bfloat16 task vectors the histogram of the keys gives the
bounds and where each run sorts (:meth:`~resumerge.merge.methods.rankstream.StreamedWindow.counted_ends`), and a cut
run's occurrences inside the window are those between two flat positions (the first occurrence kept and the first
dropped after it, found by one scan that stops there): so the mask over any range of positions is one range of keys
per span between those positions (:class:`_Span`), compared in the block that needs it.

The same bits as the whole merge (:func:`~resumerge.merge.methods.sparsify.select`, then
:func:`~resumerge.merge.methods.task_vectors.combine_task_vectors`): that multiplies each task vector by its 1/0 mask,
and so does each block here, by the same 1/0 values (split in two where the window has two ends: δ·1·1 is δ, δ·0·1 and
δ·1·0 are δ·0), then runs the same per-position core on the same blocks of positions. Only a span the window keeps
nothing of is zeroed rather than multiplied by 0, +0 where a dropped entry would be ±0 by its sign: the sign of a zero
never reaches the result (the core's sums add a zero to the other models' entries, x + ±0 = x, or, where all are
zeros, give +0; its sign election counts a zero as agreeing with neither sign). A dropped infinity or NaN would be NaN
there, so a task vector with one (the histogram's buckets of infinity and NaN) is merged the whole way instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Final

import numpy as np

from resumerge.machine.torch_import import torch
from resumerge.merge.methods import sparsify
from resumerge.merge.methods.consensus import sign_consensus_weights
from resumerge.merge.methods.ranking import exact_key_shift
from resumerge.merge.methods.rankstream import StreamedWindow
from resumerge.merge.methods.spec import MergeContext
from resumerge.merge.methods.task_vectors import TASK_VECTOR, combine_filled_blocks

if TYPE_CHECKING:
    from torch import Tensor

    from resumerge.merge.methods.spec import InputsOnly

_KEY_MAX: Final = (1 << 31) - 1  # an open upper end: every non-negative int32 key
_INFINITY_KEY: Final = 0x7F800000  # the key of |inf| (NaN's keys lie above it)
_SCAN: Final = 1 << 16  # keys compared per step while looking for an occurrence of a run (in the cache)


@dataclass(frozen=True)
class _Span:
    """Flat positions ``[start, stop)`` of a task vector, where its window keeps the keys ``low ≤ key ≤ high`` (none
    where ``low > high``)."""

    start: int
    stop: int
    low: int
    high: int


def shared_window_merge(ctx: MergeContext, selections: Mapping[int, sparsify.Selection], *, consensus: bool,
                        keys: InputsOnly, counts: InputsOnly) -> Tensor | None:
    """The whole merge of ``ctx`` (its non-base inputs sparsified by ``selections``, then combined with or without
    the sign election; no rescale) from the task vectors, ``keys`` and ``counts`` shared by the merges of ``ctx``'s
    inputs (its memo), block by block (see the module docstring); None where that does not apply (no memo, not on
    the CPU, task vectors other than bfloat16, a windowed one holding an infinity or NaN): the caller merges it the
    whole way."""
    base = ctx.base
    shift = exact_key_shift(base.dtype)
    if ctx.memo is None or base.device.type != "cpu" or shift is None:
        return None
    total = base.numel()
    spans: dict[int, tuple[_Span, ...]] = {}
    flat_keys: dict[int, Tensor] = {}
    for index in ctx.others():
        selection = selections[index]
        if not isinstance(selection, sparsify.Window):
            continue
        if ctx.from_inputs(counts, index).numpy()[_INFINITY_KEY >> shift :].any():
            return None
        window = sparsify.window_of(selection, total, base.dtype, whole=True)
        flat_keys[index] = ctx.from_inputs(keys, index).reshape(-1)
        spans[index] = _spans(window, flat_keys[index], ctx.from_inputs(counts, index))
    deltas = {index: ctx.from_inputs(TASK_VECTOR, index).reshape(-1) for index in ctx.others()}

    # One block's mask, 1/0 in the task vectors' dtype: torch's comparisons write it as fast as they write a bool
    # mask (and multiply by it several times faster than by a bool one).
    masks: list[Tensor] = []  # made at the first block, the longest

    def fill(index: int, start: int, stop: int, into: Tensor) -> None:
        delta = deltas[index]
        selection = selections[index]
        if selection == sparsify.KEEP:
            into.copy_(delta[start:stop])
            return
        if selection == sparsify.ZERO:
            into.zero_()
            return
        for span in spans[index]:
            first, last = max(start, span.start), min(stop, span.stop)
            if first >= last:
                continue
            target, found = into[first - start : last - start], flat_keys[index][first:last]
            if span.low > span.high:
                target.zero_()
            elif span.low <= 0 and span.high >= _KEY_MAX:
                target.copy_(delta[first:last])
            else:
                # δ·1·1 is δ, δ·0 (·1) is ±0: the window's product, as its one mask gives it.
                if not masks or masks[0].shape[1] < last - first:
                    masks[:] = [base.new_empty((2, stop - start))]
                low, high = masks[0][0, : last - first], masks[0][1, : last - first]
                if span.low > 0:
                    torch.mul(delta[first:last], torch.ge(found, span.low, out=low), out=target)
                else:
                    target.copy_(delta[first:last])
                if span.high < _KEY_MAX:
                    target.mul_(torch.le(found, span.high, out=high))

    weights = [float(ctx.model_params[i]["weight"]) for i in ctx.others()]
    pair = consensus and len(weights) == 2 and all(
        math.isfinite(float(torch.tensor(w, dtype=base.dtype))) for w in weights)
    combine = _ElectedPair(normalize=bool(ctx.params["normalize"]), scale=float(ctx.params["lambda"])) \
        if pair else None
    return combine_filled_blocks(ctx, fill, consensus=consensus, combine=combine)


class _ElectedPair:
    """The per-position core with the sign election over one block of two weighted task vectors
    (:func:`~resumerge.merge.methods.task_vectors._combine_block`'s bits, where the weights are finite), in fewer
    passes.

    Its two sums over the models become one ``addcmul`` each: the product of an entry and its 1/0 mask, or of a
    1/0 mask and a weight, is exact, so adding it inside ``addcmul`` (in float32, rounded once, as torch's
    half-precision add is) gives the add of the two rows bit for bit, with no row of products written first. The
    kept entries' sum keeps the combine's ``+ 0`` (a zero's sign reaches the output) and its fallback to torch's
    sum where a NaN appears; the divisor, a sum of finite weights, never holds a NaN, and its sign at zero is not
    read (±0 both become 1)."""

    def __init__(self, *, normalize: bool, scale: float) -> None:
        self._normalize, self._scale = normalize, scale

    def __call__(self, deltas: Tensor, weights: Tensor, base: Tensor, out: Tensor) -> None:
        deltas.mul_(weights)
        mask = sign_consensus_weights(deltas)
        mixed = torch.addcmul(torch.mul(deltas[0], mask[0]), deltas[1], mask[1]).add_(0.0)
        if bool(mixed.sum().isnan()):  # as row_sum: torch's own sum where the result holds a NaN
            mixed = deltas.mul_(mask).sum(dim=0)
        if self._normalize:
            divisor = torch.addcmul(mask[0].mul_(weights[0]), mask[1], weights[1])
            mixed /= divisor.add_(torch.eq(divisor, 0, out=mask[1]))
        if self._scale != 1:
            mixed *= self._scale
        torch.add(mixed, base, out=out)


def _spans(window: StreamedWindow, keys: Tensor, counts: Tensor) -> tuple[_Span, ...]:
    """The spans of positions over which ``window``'s mask of the whole ``keys`` (int32, flat) is one range of
    keys, in order, covering ``[0, total)``."""
    total = window.total
    if window.trivial:
        return (_Span(0, total, 0, _KEY_MAX) if window.start < window.stop else _Span(0, total, 1, 0),)
    lower, upper, ends = window.counted_ends(counts)
    low, high = (0 if lower is None else lower), (_KEY_MAX if upper is None else upper)
    # Each straddling run: its occurrences [keep_from, keep_to) (index order) are inside, as a stable sort places
    # them (rankstream._cut); as flat positions, those from the keep_from-th occurrence to the keep_to-th.
    runs: list[tuple[int, int, int]] = []  # (key, first position inside, first position after)
    for key, (ahead, length) in sorted(ends.items()):
        keep_from, keep_to = max(0, window.start - ahead), max(0, window.stop - ahead)
        if keep_from <= 0 and keep_to >= length:
            continue  # wholly inside (or never reached): the key range says it all
        found = _occurrences(keys, key, [n for n in (keep_from, keep_to) if 0 < n < length])
        begin = 0 if keep_from <= 0 else found[keep_from] if keep_from < length else total
        end = total if keep_to >= length else found[keep_to] if keep_to > 0 else 0
        runs.append((key, begin, end))
    cuts = sorted({0, total, *(p for _, begin, end in runs for p in (begin, end))})
    found_spans = []
    for start, stop in pairwise(cuts):
        span_low, span_high = low, high
        for key, begin, end in runs:
            if stop <= begin or start >= end:  # this run's occurrences here sort outside the window
                if key == low:
                    span_low = key + 1
                if key == high:
                    span_high = key - 1
        found_spans.append(_Span(start, stop, span_low, span_high))
    return tuple(found_spans)


def _occurrences(keys: Tensor, key: int, numbers: list[int]) -> dict[int, int]:
    """The flat position of occurrence ``n`` (0-based, index order) of ``key`` in ``keys`` for each ``n`` of
    ``numbers`` (each below the run's length), a step at a time, stopping once the last is found: a step's
    occurrences are counted, and their positions listed only in a step that holds one asked for."""
    if not numbers:
        return {}
    values = keys.numpy()
    wanted, found, seen = sorted(set(numbers)), {}, 0
    for start in range(0, values.size, _SCAN):
        equal = values[start : start + _SCAN] == key
        count = int(np.count_nonzero(equal))
        if wanted[0] < seen + count:
            hits = np.flatnonzero(equal)
            while wanted and wanted[0] < seen + count:
                number = wanted.pop(0)
                found[number] = start + int(hits[number - seen])
            if not wanted:
                break
        seen += count
    return found
