"""``ties``, ``breadcrumbs`` and ``breadcrumbs_ties`` over row chunks: the :class:`~resumerge.methods.spec.RowStream`
of the rank-window sparsifiers.

Their only whole-tensor step is each task vector's rank window; :class:`~resumerge.methods.rankstream.
StreamedWindow` finds it in one or two statistics passes over the chunks (one for half-precision task vectors),
and the output pass masks each chunk and runs the shared per-position core
(:func:`~resumerge.methods.task_vectors.combine_task_vectors`). A ``rescale`` needs the whole tensor's L1 sums,
rounded as torch rounds one sum over the whole tensor, so such a tensor is left to the whole-tensor path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from resumerge.methods import sparsify
from resumerge.methods.ranking import exact_key_shift
from resumerge.methods.rankstream import StreamedWindow
from resumerge.methods.spec import MergeContext, RowStream, RowStreamFactory
from resumerge.methods.task_vectors import combine_task_vectors
from resumerge.torch_import import torch

if TYPE_CHECKING:
    from torch import Tensor

# (number of entries, one model's resolved parameters) -> what its sparsifier keeps.
Selector = Callable[[int, Mapping[str, Any]], sparsify.Selection]


def magnitude_selector(numel: int, p: Mapping[str, Any]) -> sparsify.Selection:
    """TIES: :func:`~resumerge.methods.sparsify.magnitude`'s selection."""
    return sparsify.magnitude_selection(numel, float(p["density"]))


def outlier_selector(numel: int, p: Mapping[str, Any]) -> sparsify.Selection:
    """Breadcrumbs: :func:`~resumerge.methods.sparsify.magnitude_outliers`' selection."""
    return sparsify.outlier_selection(numel, float(p["density"]), float(p["gamma"]))


class TaskVectorStream:
    """One tensor of a rank-window method over row chunks (a :class:`~resumerge.methods.spec.RowStream`)."""

    def __init__(self, selections: Mapping[int, sparsify.Selection], total: int, *, consensus: bool) -> None:
        self._selections, self._total = dict(selections), total
        self._consensus = consensus
        self._windows: dict[int, StreamedWindow] | None = None  # built at the first chunk, which fixes the dtype
        self._active: list[int] = []

    prefer_whole = False  # as fast as the whole tensor (measured: breadcrumbs 15.3 s streamed, 15.7-16.1 whole)

    def held_bytes(self) -> int:
        """Nothing that grows with the tensor: the windows' counts are fixed-size histograms (well under the
        governor's margin)."""
        return 0

    def wants(self, pass_index: int) -> bool:
        """True while some task vector's window needs statistics pass ``pass_index``."""
        if pass_index == 0:
            return any(isinstance(s, sparsify.Window) and not self._window(s, None).trivial
                       for s in self._selections.values())
        self._active = [i for i, w in self._built(None).items() if w.wants(pass_index)]
        return bool(self._active)

    def observe(self, pass_index: int, ctx: MergeContext) -> None:
        """Count one chunk's task-vector magnitudes."""
        base = ctx.base
        if self._windows is None:
            self._active = [i for i, w in self._built(base.dtype).items() if w.wants(0)]
        windows = self._built(base.dtype)
        for index in self._active:
            windows[index].observe(pass_index, sparsify.delta_keys(ctx.tensors[index] - base))

    def apply(self, ctx: MergeContext) -> Tensor:
        """The merged rows of the next chunk."""
        windows = self._built(ctx.base.dtype)

        def sparsify_one(index: int, delta: Tensor) -> Tensor:
            window = windows.get(index)
            if window is None:
                return sparsify.select(delta, self._selections[index], rescale=False, inplace=True)
            # The product a whole-tensor select takes (rescale off): delta × its 1/0 mask, in place.
            return delta.mul_(window.mask(sparsify.delta_keys(delta), delta.dtype).reshape(delta.shape))

        return combine_task_vectors(ctx, sparsify_one, consensus=self._consensus)

    def _window(self, selection: sparsify.Window, dtype: torch.dtype | None) -> StreamedWindow:
        shift = exact_key_shift(dtype) if dtype is not None else None
        return StreamedWindow(self._total, selection.start, selection.stop, descending=selection.descending,
                              shift=shift)

    def _built(self, dtype: torch.dtype | None) -> dict[int, StreamedWindow]:
        if self._windows is None:
            if dtype is None:
                raise ValueError("a statistics pass was asked for before any chunk was seen")
            self._windows = {i: self._window(s, dtype) for i, s in self._selections.items()
                             if isinstance(s, sparsify.Window)}
        return self._windows


def task_vector_stream(selector: Selector, *, consensus: bool) -> RowStreamFactory:
    """The :class:`~resumerge.methods.spec.RowStreamFactory` of a rank-window method."""

    def factory(shape: tuple[int, ...], base_index: int | None, model_params: Sequence[Mapping[str, Any]],
                params: Mapping[str, Any], *, dtype: str | None = None) -> RowStream | None:
        total = math.prod(shape)
        if base_index is None or total == 0 or bool(params["rescale"]):
            return None
        others = [i for i in range(len(model_params)) if i != base_index]
        selections = {i: selector(total, model_params[i]) for i in others}
        return TaskVectorStream(selections, total, consensus=consensus)

    return factory

