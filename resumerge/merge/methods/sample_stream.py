"""``dare_ties``, ``dare_linear``, ``della`` and ``della_linear``: the one definition of the randomized
sparsifiers, a :class:`~resumerge.merge.methods.spec.RowStream` over row chunks of a tensor, whose whole-tensor form is
the same stream over one chunk (:func:`~resumerge.merge.methods.spec.one_chunk`).

The whole task vectors are drawn in turn from one generator (all of δ₁'s entries, then δ₂'s, …) and rescaled by
two L1 norms over the whole task vector. Over one chunk that is what the output pass does: each task vector's mask
is drawn, applied and counted in place (:func:`~resumerge.merge.methods.sparsify.draw_and_mask`), then the combine
runs, and no statistics pass is asked for. Over several chunks one statistics pass draws every task vector's
mask chunk by chunk with the same function, each from its own copy of the generator moved on by the draws of the
task vectors before it, keeps the masks (a byte an entry) and feeds both norms to the same ordered sums; the
output pass masks and rescales each chunk. Either way the per-position core
(:func:`~resumerge.merge.methods.task_vectors.combine_task_vectors`) follows: the same bits for every chunking.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods import sparsify
from resumerge.merge.methods.spec import MergeContext, RowStream, RowStreamFactory
from resumerge.merge.methods.task_vectors import combine_task_vectors

if TYPE_CHECKING:
    from torch import Tensor

# Entries drawn per call while moving a generator on past another task vector's draws.
_SKIP_BLOCK = 1 << 16


@dataclass
class _Drawn:
    """One task vector's state across the passes: its generator, mask and norms."""

    generator: torch.Generator
    mask: Tensor  # uint8, one entry per task-vector entry, filled by the statistics pass
    norms: sparsify.Norms | None  # L1 before and after masking, with rescale
    ratio: Tensor | None = None  # before / after, once known (None: the mask is applied unscaled)


class SampledStream:
    """One tensor of a randomized task-vector method over row chunks (a
    :class:`~resumerge.merge.methods.spec.RowStream`)."""

    def __init__(self, samples: Mapping[int, sparsify.Sampled], total: int, *, consensus: bool, rescale: bool,
                 whole: bool = False) -> None:
        self._samples, self._total = dict(samples), total
        self._consensus, self._rescale, self._whole = consensus, rescale, whole
        self._drawn: dict[int, _Drawn] = {}
        self._position = 0  # entries of the task vectors seen so far in the current pass

    # Slower than the whole tensor (della on the 1.75 GB bench: 29.6 s streamed, 16.7 s whole; an extra pass of
    # reads, the generator moved on, masks stored and summed in pieces): for tensors that do not fit whole.
    prefer_whole = True

    def held_bytes(self) -> int:
        """The masks kept from the statistics pass to the output pass."""
        return self._total * sum(1 for s in self._samples.values() if sparsify.sampled_draws(s))

    def wants(self, pass_index: int) -> bool:
        """One statistics pass, drawing the masks, when some task vector is sampled at all and the tensor comes in
        several chunks (over one chunk the output pass draws them)."""
        return (pass_index == 0 and not self._whole
                and any(sparsify.sampled_draws(s) for s in self._samples.values()))

    def observe(self, pass_index: int, ctx: MergeContext) -> None:
        """Draw one chunk's masks and take its norms."""
        base = ctx.base
        if not self._drawn:
            self._start(ctx, base.dtype)
        count = base.numel()
        scratch = sparsify.Scratch()
        for index, drawn in self._drawn.items():
            values = (ctx.tensors[index] - base).to(sparsify.rescale_dtype(base.dtype))  # ours to overwrite
            keep = drawn.mask[self._position : self._position + count]
            sparsify.draw_and_mask(values, self._samples[index], drawn.generator, norms=drawn.norms, keep=keep,
                                   scratch=scratch)
        self._position += count
        if self._position == self._total:
            self._position = 0
            for drawn in self._drawn.values():
                drawn.ratio = sparsify.rescale_ratio(drawn.norms)

    def apply(self, ctx: MergeContext) -> Tensor:
        """The merged rows of the next chunk (over one chunk: each task vector drawn, masked and rescaled here)."""
        count = ctx.base.numel()
        first = self._position
        # One tensor's task vectors are drawn in turn in the same working buffers, dropped after the last draw
        # (the combine that follows needs none of them).
        scratch = sparsify.Scratch()
        last = max(self._samples, default=None)

        def sparsify_one(index: int, delta: Tensor) -> Tensor:
            sample = self._samples[index]
            if self._whole:
                sparse = sparsify.sample(delta, sample, rescale=self._rescale, generator=ctx.generator, inplace=True,
                                         scratch=scratch)
                if index == last:
                    scratch.clear()
                return sparse
            drawn = self._drawn.get(index)
            if drawn is None:  # nothing drawn: kept whole, or (DELLA at density 0) zeroed
                return delta if sample.density >= 1 else delta.zero_()
            work = sparsify.rescale_dtype(delta.dtype)
            values = delta.to(work)  # delta itself, or a fresh copy: ours to overwrite either way
            values.mul_(drawn.mask[first : first + count].view(delta.shape).to(work))
            if drawn.ratio is not None:
                values.mul_(drawn.ratio)
            return values.to(delta.dtype)

        # Whole, the result goes in the engine's reused buffer: a fresh one's pages are zeroed by the kernel first.
        out = combine_task_vectors(ctx, sparsify_one, consensus=self._consensus, lent=self._whole)
        self._position += count
        return out

    def _start(self, ctx: MergeContext, dtype: torch.dtype) -> None:
        # Every chunk's context holds a generator freshly seeded for this tensor; the first one's is the whole
        # tensor's. Task vectors draw one 32-bit word per entry, in config order, so each one's generator is the
        # seeded one moved on by the entries of the sampled task vectors before it.
        if ctx.generator is None:
            raise ValueError("a randomized sparsifier needs an explicit torch.Generator (never the global RNG)")
        source = ctx.generator
        work = sparsify.rescale_dtype(dtype)
        drawing = [index for index in sorted(self._samples) if sparsify.sampled_draws(self._samples[index])]
        for index in drawing:
            own = torch.Generator()
            own.set_state(source.get_state())
            norms = sparsify.l1_norms(self._total, work) if self._rescale else None
            self._drawn[index] = _Drawn(own, torch.empty(self._total, dtype=torch.uint8), norms)
            if index != drawing[-1]:  # the words this task vector's mask will take, for the ones after it
                _skip_words(source, self._total)


def _skip_words(generator: torch.Generator, words: int) -> None:
    # Moves the generator on by `words` 32-bit words. A float64 uniform_ takes two words an entry (torch builds
    # each double from two 32-bit draws) at 2.7x the speed per word of the float32 draw the masks use (measured
    # here: 0.95 against 2.5 ns a word), so the pairs go through float64 and an odd word through float32.
    pairs, odd = divmod(words, 2)
    scratch = torch.empty(min(pairs, _SKIP_BLOCK), dtype=torch.float64)
    for start in range(0, pairs, _SKIP_BLOCK):
        scratch[: min(_SKIP_BLOCK, pairs - start)].uniform_(generator=generator)
    if odd:
        torch.empty(1, dtype=torch.float32).uniform_(generator=generator)


def sampled_stream(*, della: bool, consensus: bool) -> RowStreamFactory:
    """The :class:`~resumerge.merge.methods.spec.RowStreamFactory` of a randomized task-vector method with these
    defaults (DELLA's ranks run along dim 1, so only tensors of two dimensions or more are cut into chunks)."""

    def factory(shape: tuple[int, ...], base_index: int | None, model_params: Sequence[Mapping[str, Any]],
                params: Mapping[str, Any], *, dtype: str | None = None, whole: bool = False) -> RowStream | None:
        total = math.prod(shape)
        if not whole and (base_index is None or total == 0 or (della and len(shape) < 2)):
            return None
        samples = {}
        for index, p in enumerate(model_params):
            if index == base_index:
                continue
            density = float(p["density"])
            epsilon = float(p["epsilon"]) if della else None
            samples[index] = sparsify.Sampled(density, epsilon)
        # The combine reads `normalize` from each chunk's context; `rescale` decides the statistics pass.
        return SampledStream(samples, total, consensus=consensus, rescale=bool(params["rescale"]), whole=whole)

    return factory
