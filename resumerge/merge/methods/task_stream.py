"""``ties``, ``breadcrumbs`` and ``breadcrumbs_ties``: the one definition of the rank-window sparsifiers, a
:class:`~resumerge.merge.methods.spec.RowStream` over row chunks of a tensor, whose whole-tensor form is the same stream
over one chunk (:func:`~resumerge.merge.methods.spec.one_chunk`).

Their only whole-tensor steps are each task vector's rank window and, with ``rescale``, its two L1 norms. Over one
chunk the output pass finds both in the chunk it holds (:func:`~resumerge.merge.methods.sparsify.select`). Over several
chunks the window (:class:`~resumerge.merge.methods.rankstream.StreamedWindow`) takes one or two statistics passes (one
for half-precision task vectors), a ``rescale`` one more that feeds the norms to ordered sums (the order the
one-piece norms are summed in), and the output pass masks and rescales each chunk. Either way the shared
per-position core (:func:`~resumerge.merge.methods.task_vectors.combine_task_vectors`) follows: the same bits for every
chunking.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods import sparsify
from resumerge.merge.methods.footprint import dtype_size
from resumerge.merge.methods.ranking import exact_key_shift
from resumerge.merge.methods.rankstream import StreamedWindow, key_counts
from resumerge.merge.methods.spec import InputsOnly, MergeContext, RowSelection, RowStream, RowStreamFactory
from resumerge.merge.methods.summation import OrderedSum
from resumerge.merge.methods.task_blocks import shared_window_merge
from resumerge.merge.methods.task_vectors import TASK_VECTOR, combine_task_vectors

if TYPE_CHECKING:
    from torch import Tensor

def _task_keys(ctx: MergeContext, index: int) -> Tensor:
    return sparsify.delta_keys(ctx.from_inputs(TASK_VECTOR, index))


# The magnitude keys of δᵢ by which the windows rank it, of the inputs alone: a generation's candidates share them
# (int32 keys, int64 for float64 task vectors).
TASK_KEYS = InputsOnly("task vector keys", _task_keys, lambda itemsize: 8 if itemsize == 8 else 4)


def _keys(ctx: MergeContext, index: int, delta: Tensor) -> Tensor:
    """The keys of input ``index``'s task vector ``delta`` (just computed, not sparsified yet): shared where the
    engine shares them, else found in ``delta``."""
    return sparsify.delta_keys(delta) if ctx.memo is None else ctx.from_inputs(TASK_KEYS, index)


def _task_key_counts(ctx: MergeContext, index: int) -> Tensor:
    shift = exact_key_shift(ctx.base.dtype)
    if shift is None:
        raise ValueError("internal: a histogram of the keys is exact for bfloat16 task vectors only")
    return key_counts(ctx.from_inputs(TASK_KEYS, index), shift)


# The histogram of those keys' high bits (bfloat16 task vectors: each bucket one key), of the inputs alone: where a
# generation's candidates merge some rows of a tensor, each window's bounds read from it instead of a selection
# (2¹⁵ counts: a fixed 256 KiB, nothing per entry).
TASK_KEY_COUNTS = InputsOnly("task vector key counts", _task_key_counts, lambda itemsize: 0)


# (number of entries, one model's resolved parameters) -> what its sparsifier keeps.
Selector = Callable[[int, Mapping[str, Any]], sparsify.Selection]


def magnitude_selector(numel: int, p: Mapping[str, Any]) -> sparsify.Selection:
    """TIES: :func:`~resumerge.merge.methods.sparsify.magnitude`'s selection."""
    return sparsify.magnitude_selection(numel, float(p["density"]))


def outlier_selector(numel: int, p: Mapping[str, Any]) -> sparsify.Selection:
    """Breadcrumbs: :func:`~resumerge.merge.methods.sparsify.magnitude_outliers`' selection."""
    return sparsify.outlier_selection(numel, float(p["density"]), float(p["gamma"]))


class TaskVectorStream:
    """One tensor of a rank-window method over row chunks (a :class:`~resumerge.merge.methods.spec.RowStream`)."""

    def __init__(self, selections: Mapping[int, sparsify.Selection], total: int, *, consensus: bool,
                 rescale: bool, whole: bool = False, dtype: str | None = None) -> None:
        self._selections, self._total = dict(selections), total
        self._consensus, self._rescale, self._whole = consensus, rescale, whole
        self._itemsize = dtype_size(dtype or "float64")  # for held_bytes: the widest, when not known
        self._windows: dict[int, StreamedWindow] | None = None  # built at the first chunk, which fixes the dtype
        self._active: list[int] = []
        self._norms: dict[int, sparsify.Norms] = {}  # with rescale, per windowed task vector
        self._norm_pass: int | None = None  # the statistics pass that feeds them, once the windows are found
        self._ratios: dict[int, Tensor | None] | None = None
        # Without rescale as fast as the whole tensor (measured: breadcrumbs 15.3 s streamed, 15.7-16.1 whole); a
        # rescale's norm pass reads the inputs once more (ties with rescale: a third more CPU on the bench), so such
        # a tensor streams only when it does not fit whole.
        self.prefer_whole = rescale

    def held_bytes(self) -> int:
        """The ordered sums' fold buffers of a ``rescale``; the windows' counts are fixed-size histograms (well
        under the governor's margin)."""
        windowed = sum(1 for s in self._selections.values() if isinstance(s, sparsify.Window))
        return 2 * windowed * OrderedSum.buffer_bytes(self._total, self._itemsize) if self._rescale else 0

    def wants(self, pass_index: int) -> bool:
        """While some task vector's window needs statistics pass ``pass_index``; then, with ``rescale``, the pass
        that takes the norms. None over one chunk (its output pass finds both)."""
        if self._whole:
            return False
        windowed = [s for s in self._selections.values() if isinstance(s, sparsify.Window)]
        if pass_index == 0:
            return any(self._rescale or not self._window(s, None).trivial for s in windowed)
        if self._norm_pass is None:
            self._active = [i for i, w in self._built(None).items() if w.wants(pass_index)]
            if self._active or not self._rescale:
                return bool(self._active)
            self._norm_pass = pass_index
            return True
        return False

    def observe(self, pass_index: int, ctx: MergeContext) -> None:
        """Count one chunk's task-vector magnitudes, or (the norm pass) feed its norms."""
        base = ctx.base
        if self._windows is None:
            self._active = [i for i, w in self._built(base.dtype).items() if w.wants(0)]
            if not self._active and self._rescale:
                self._norm_pass = 0  # every window is trivial: the first pass takes the norms
        windows = self._built(base.dtype)
        if pass_index == self._norm_pass:
            for index, window in windows.items():
                delta = ctx.tensors[index] - base
                mask = window.mask(_keys(ctx, index, delta), delta.dtype)
                norms = self._norms.setdefault(index, sparsify.l1_norms(self._total, delta.dtype, delta.device))
                sparsify.mask_in_place(delta, mask.reshape(delta.shape), norms)
            return
        for index in self._active:
            windows[index].observe(pass_index, ctx.from_inputs(TASK_KEYS, index))

    def apply(self, ctx: MergeContext) -> Tensor:
        """The merged rows of the next chunk (over one chunk: each task vector's window and norms found here)."""
        if self._whole:
            if not self._rescale:  # a generation's candidate: from the shared task vectors and keys, block by block
                found = shared_window_merge(ctx, self._selections, consensus=self._consensus, keys=TASK_KEYS,
                                            counts=TASK_KEY_COUNTS)
                if found is not None:
                    return found

            def sparsify_one(index: int, delta: Tensor) -> Tensor:
                selection = self._selections[index]
                keys = ctx.from_inputs(TASK_KEYS, index) if ctx.memo is not None and isinstance(
                    selection, sparsify.Window) else None
                return sparsify.select(delta, selection, rescale=self._rescale, inplace=True, keys=keys)

            return combine_task_vectors(ctx, sparsify_one, consensus=self._consensus)
        windows = self._built(ctx.base.dtype)
        ratios = self._finish_norms(windows)

        def sparsify_chunk(index: int, delta: Tensor) -> Tensor:
            window = windows.get(index)
            if window is None:  # kept whole or zeroed: no window, no rescale
                return sparsify.select(delta, self._selections[index], rescale=False, inplace=True)
            sparsify.mask_in_place(delta, window.mask(_keys(ctx, index, delta), delta.dtype).reshape(delta.shape))
            ratio = ratios.get(index)
            return delta if ratio is None else delta.mul_(ratio)

        return combine_task_vectors(ctx, sparsify_chunk, consensus=self._consensus)

    def _finish_norms(self, windows: Mapping[int, StreamedWindow]) -> dict[int, Tensor | None]:
        # The rescale factors, once, before the first output chunk; the windows mask again from the first chunk.
        if self._ratios is None:
            self._ratios = {i: sparsify.rescale_ratio(norms) for i, norms in self._norms.items()}
            if self._norms:
                for window in windows.values():
                    window.rewind()
        return self._ratios

    def _window(self, selection: sparsify.Window, dtype: torch.dtype | None) -> StreamedWindow:
        return sparsify.window_of(selection, self._total, dtype if dtype is not None else torch.float32)

    def _built(self, dtype: torch.dtype | None) -> dict[int, StreamedWindow]:
        if self._windows is None:
            if dtype is None:
                raise ValueError("a statistics pass was asked for before any chunk was seen")
            self._windows = {i: self._window(s, dtype) for i, s in self._selections.items()
                             if isinstance(s, sparsify.Window)}
        return self._windows


def task_vector_stream(selector: Selector, *, consensus: bool) -> RowStreamFactory:
    """The :class:`~resumerge.merge.methods.spec.RowStreamFactory` of a rank-window method."""

    def factory(shape: tuple[int, ...], base_index: int | None, model_params: Sequence[Mapping[str, Any]],
                params: Mapping[str, Any], *, dtype: str | None = None,
                whole: bool = False) -> RowStream | None:
        total = math.prod(shape)
        if not whole and (base_index is None or total == 0):
            return None
        others = [i for i in range(len(model_params)) if i != base_index]
        selections = {i: selector(total, model_params[i]) for i in others}
        return TaskVectorStream(selections, total, consensus=consensus, rescale=bool(params["rescale"]),
                                whole=whole, dtype=dtype)

    return factory


def task_vector_rows(selector: Selector, *, consensus: bool) -> RowSelection:
    """The :class:`~resumerge.merge.methods.spec.RowSelection` of a rank-window method: each task vector's window found
    among the keys of the whole tensor (shared where the engine shares them), its mask built at the rows asked for
    only, and the per-position core (:func:`~resumerge.merge.methods.task_vectors.combine_task_vectors`) run on those
    rows alone (where the engine shares them, bfloat16 windows' bounds are read from the whole tensor's one
    histogram of keys, :data:`TASK_KEY_COUNTS`, instead of a selection per merge). Exact without ``rescale``
    (whose norms are sums over every kept entry of the tensor)."""

    def exact(params: Mapping[str, Any], model_params: Sequence[Mapping[str, Any]]) -> bool:
        return not bool(params["rescale"])

    def merge(ctx: MergeContext, rows: Tensor) -> Tensor:
        base = ctx.base
        total, width = base.numel(), math.prod(base.shape[1:])
        positions = (rows.reshape(-1, 1) * width + torch.arange(width, device=rows.device)).reshape(-1)
        selections = {i: selector(total, ctx.model_params[i]) for i in ctx.others()}
        masks: dict[int, Tensor] = {}
        for index, selection in selections.items():
            if isinstance(selection, sparsify.Window):
                keys = sparsify.delta_keys(ctx.from_inputs(TASK_VECTOR, index)) if ctx.memo is None else \
                    ctx.from_inputs(TASK_KEYS, index)
                window = sparsify.window_of(selection, total, base.dtype, whole=True)
                # Shared by every merge of these inputs: the bounds read from one histogram for all of them.
                counts = ctx.from_inputs(TASK_KEY_COUNTS, index) if ctx.memo is not None and exact_key_shift(
                    base.dtype) is not None else None
                masks[index] = window.mask_at(keys, positions, base.dtype, counts)

        def sparsify_rows(index: int, delta: Tensor) -> Tensor:
            mask = masks.get(index)
            if mask is None:  # kept whole or zeroed
                return sparsify.select(delta, selections[index], rescale=False, inplace=True)
            return delta.mul_(mask.reshape(delta.shape))

        picked = replace(ctx, tensors=[t[rows] for t in ctx.tensors], memo=None, lend=None)
        return combine_task_vectors(picked, sparsify_rows, consensus=consensus)

    return RowSelection(exact, merge)
