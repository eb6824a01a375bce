"""``sce``: the one definition of SCE, a :class:`~resumerge.merge.methods.spec.RowStream` over row chunks of a tensor,
whose whole-tensor form is the same stream over one chunk (:func:`~resumerge.merge.methods.spec.one_chunk`).

SCE has three whole-tensor steps: how many positions have a nonzero variance across the task vectors (which sets
the ``select_topk`` window), the window itself over the variances, and each task vector's energy (mean square
after the selection). Everything else is per position. Over one chunk the output pass takes all three from the
chunk it holds (:func:`~resumerge.merge.methods.sce_steps.variance_mask`, :func:`~resumerge.merge.methods.sce_steps.
energy_weights`). Over several chunks the stream

1. counts the nonzero variances and histograms their keys (the window's first pass, deferred until the count
   gives its size: :class:`~resumerge.merge.methods.rankstream.StreamedWindow`);
2. for float32 and float16 variances, counts the low bits of the keys at the window's ends (bfloat16 keys are
   exact after step 1);
3. masks each chunk, keeps the mask (a byte a position) and feeds every task vector's squares to an ordered sum
   (:class:`~resumerge.merge.methods.summation.OrderedSum`, the order the one-chunk energies are summed in too);

and either way the output pass runs SCE's per-position steps (:func:`~resumerge.merge.methods.sce_steps.agreement_sum`,
:func:`~resumerge.merge.methods.sce_steps.agreement_mean`). Without a window (``select_topk`` ≥ 1 or ≤ 0) only step 3
runs. Float64 variances rank by int64 keys, which the streamed window does not count, so float64 tensors ranked by
variance are computed in one chunk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import dtype_size
from resumerge.merge.methods.ranking import exact_key_shift, magnitude_keys
from resumerge.merge.methods.rankstream import StreamedWindow
from resumerge.merge.methods.sce_steps import (
    agreement_mean,
    agreement_sum,
    energy_weights,
    normalised_energy,
    population_variance,
    stacked_task_vectors,
    variance_count,
    variance_mask,
)
from resumerge.merge.methods.spec import MergeContext, RowStream
from resumerge.merge.methods.summation import OrderedSum

if TYPE_CHECKING:
    from torch import Tensor


class SceStream:
    """One tensor of ``sce`` over row chunks (a :class:`~resumerge.merge.methods.spec.RowStream`)."""

    def __init__(self, total: int, models: int, fraction: float, *, int8: bool,
                 dtype: str | None = None, whole: bool = False) -> None:
        self._total, self._models, self._fraction, self._int8 = total, models, fraction, int8
        self._whole = whole
        self._itemsize = dtype_size(dtype or "float64")  # for held_bytes: the widest, when not known
        self._window: StreamedWindow | None = None  # built at the first chunk (its keys' dtype), when ranking
        self._nonzero = 0
        self._energy: list[OrderedSum] = []
        self._weights: Tensor | None = None  # the normalised energies, after the energy pass
        self._mask: Tensor | None = None  # the window's mask, one byte a position, kept for the output pass
        self._position = 0
        # The pass that sums the energies: the first without a window, else the one after the window's passes.
        self._energy_pass = -1 if self._ranks else 0

    # Three passes over the inputs (four when the first chunk forecasts the window's ends wrong, two without a
    # window) where the whole tensor takes one: 34.3 s against 20.7 s whole on the bench. For tensors that do not
    # fit whole.
    prefer_whole = True

    @property
    def _ranks(self) -> bool:
        return 0 < self._fraction < 1

    def held_bytes(self) -> int:
        """The window's mask (a byte a position) and the ordered sums' fold buffers."""
        return (self._total if self._ranks else 0) + self._models * OrderedSum.buffer_bytes(self._total, self._itemsize)

    def wants(self, pass_index: int) -> bool:
        """The window's passes (while ranking), then the energy pass; none over one chunk."""
        if self._whole:
            return False
        if not self._ranks:
            return pass_index == 0
        if pass_index == 0:
            return True  # the count and the coarse histogram
        window = self._window
        if window is None:
            raise ValueError("a statistics pass was asked for before any chunk was seen")
        if pass_index == 1:
            window.retarget(0, variance_count(self._nonzero, self._fraction))
        if self._energy_pass < 0:
            if window.wants(pass_index):
                return True
            self._energy_pass = pass_index
            self._mask = torch.empty(self._total, dtype=torch.uint8)
        return pass_index == self._energy_pass

    def observe(self, pass_index: int, ctx: MergeContext) -> None:
        """One chunk's statistics for pass ``pass_index``."""
        task_vectors = stacked_task_vectors(ctx)
        if not self._energy:
            self._start(task_vectors.dtype)
        if pass_index != self._energy_pass:
            if task_vectors.dtype == torch.float64:
                raise ValueError("sce ranks float64 variances by 64-bit keys, which its stream does not count")
            variance = population_variance(task_vectors)
            if pass_index == 0:
                nonzero = int(torch.count_nonzero(variance))
                self._nonzero += nonzero
                if self._window is None:
                    self._window = self._forecast_window(variance.dtype, nonzero, variance.numel())
            assert self._window is not None
            self._window.observe(pass_index, magnitude_keys(variance.abs()))
            return
        selected = self._select(task_vectors, store=True)
        for energy, vector in zip(self._energy, selected, strict=True):
            energy.add(vector.square())
        self._position += selected[0].numel()
        if self._position == self._total:
            self._position = 0
            self._weights = normalised_energy(self._energy, self._total, task_vectors.dtype)

    def apply(self, ctx: MergeContext) -> Tensor:
        """The merged rows of the next chunk: B + Σᵢ eᵢ·mᵢ·δᵢ / max(Σᵢ eᵢ·mᵢ, 1e-6), in the inputs' dtype.

        δᵢ are the task vectors restricted to the top ``select_topk`` fraction of positions by variance (all
        positions when ``select_topk ≥ 1``), eᵢ their :func:`~resumerge.merge.methods.sce_steps.energy_weights`, and mᵢ
        the TIES sign-agreement mask. There is no per-model weight. Equal variances straddling the ``select_topk``
        cut are selected lowest index first, the one deliberate difference from mergekit. Without non-base inputs
        the result is a copy of the base; raises ``ValueError`` without a base.
        """
        if self._whole:
            return self._one_chunk(ctx)
        if self._weights is None:
            raise ValueError("the output pass was asked for before the energy pass")
        selected = self._select(stacked_task_vectors(ctx), store=False)
        self._position += selected[0].numel()
        merged, kept = agreement_sum(selected, self._weights)
        del selected
        return agreement_mean(merged, kept, ctx.base)

    def _one_chunk(self, ctx: MergeContext) -> Tensor:
        # The whole tensor in hand: its window and energies from it (every step mergekit's, in the same order and
        # dtype; only the temporaries are gone: products in place, the sign mask built as numbers).
        base = ctx.base
        if not ctx.others() or base.numel() == 0:
            return base.clone()
        task_vectors = stacked_task_vectors(ctx)
        if self._fraction < 1:
            dtype = torch.int8 if self._int8 else base.dtype
            task_vectors.mul_(variance_mask(task_vectors, self._fraction, dtype))
        merged, kept = agreement_sum(task_vectors, energy_weights(task_vectors))
        del task_vectors  # a stack of tensor-sizes, not needed for the division
        return agreement_mean(merged, kept, base)

    def _select(self, task_vectors: Tensor, *, store: bool) -> Tensor:
        # task_vectors × the window's mask, in place, as the whole tensor's variance_mask multiplies them.
        dtype = torch.int8 if self._int8 else task_vectors.dtype
        if self._fraction >= 1:
            return task_vectors
        if self._fraction <= 0:
            return task_vectors.mul_(torch.zeros(task_vectors.shape[1:], dtype=dtype))
        count = task_vectors[0].numel()
        assert self._mask is not None and self._window is not None
        stored = self._mask[self._position : self._position + count]
        if store:
            keys = magnitude_keys(population_variance(task_vectors).abs())
            stored.copy_(self._window.mask(keys, torch.uint8).reshape(-1))
        return task_vectors.mul_(stored.view(task_vectors.shape[1:]).to(dtype))

    def _start(self, dtype: torch.dtype) -> None:
        self._energy = [OrderedSum(self._total, dtype) for _ in range(self._models)]

    def _forecast_window(self, dtype: torch.dtype, nonzero: int, count: int) -> StreamedWindow:
        # The first chunk (`nonzero` of its `count` variances nonzero) forecasts the window, scaled to the tensor,
        # so the first pass counts the low bits around its end and float32 keys rarely need a second pass.
        forecast = variance_count(round(nonzero / count * self._total), self._fraction)
        window = StreamedWindow(self._total, 0, forecast, descending=True, shift=exact_key_shift(dtype),
                                deferred=True)
        window.wants(0)
        return window


def sce_stream(shape: tuple[int, ...], base_index: int | None, model_params: Sequence[Mapping[str, Any]],
               params: Mapping[str, Any], *, dtype: str | None = None,
               whole: bool = False) -> RowStream | None:
    """The :class:`~resumerge.merge.methods.spec.RowStreamFactory` of ``sce`` (not ``whole``, None: computed in one
    chunk, for a tensor without a base, non-base inputs or entries, or float64 ranked by variance)."""
    total = math.prod(shape)
    models = len(model_params) - 1
    fraction = float(params["select_topk"])
    if not whole and (base_index is None or total == 0 or models < 1 or (dtype == "float64" and 0 < fraction < 1)):
        return None
    return SceStream(total, models, fraction, int8=bool(params["int8_mask"]), dtype=dtype, whole=whole)
