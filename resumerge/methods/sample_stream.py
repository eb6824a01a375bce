"""``dare_ties``, ``dare_linear``, ``della`` and ``della_linear`` over row chunks: the
:class:`~resumerge.methods.spec.RowStream` of the randomized sparsifiers.

The whole-tensor merge draws each task vector's mask in turn from one generator (all of δ₁'s entries, then δ₂'s,
…) and rescales it by two L1 norms over the whole task vector. Here one statistics pass draws every task vector's
mask chunk by chunk, each from its own copy of the generator moved on by the draws of the task vectors before it,
keeps the masks (a byte an entry) and feeds both norms to ordered sums
(:class:`~resumerge.methods.summation.OrderedSum`, the order the whole-tensor norms are summed in too). The output
pass masks and rescales each chunk and runs the shared per-position core
(:func:`~resumerge.methods.task_vectors.combine_task_vectors`): the same bits as the whole tensor, holding a
chunk's buffers, the masks and the output instead of a dozen tensor-sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resumerge.methods import sparsify
from resumerge.methods.spec import MergeContext, RowStream, RowStreamFactory
from resumerge.methods.summation import OrderedSum
from resumerge.methods.task_vectors import combine_task_vectors
from resumerge.torch_import import torch

if TYPE_CHECKING:
    from torch import Tensor

# Entries drawn per call while moving a generator on past another task vector's draws.
_SKIP_BLOCK = 1 << 16


@dataclass
class _Drawn:
    """One task vector's state across the passes: its generator, mask and norms."""

    generator: torch.Generator
    mask: Tensor  # uint8, one entry per task-vector entry, filled by the statistics pass
    norms: tuple[OrderedSum, OrderedSum] | None  # L1 before and after masking, with rescale
    ratio: Tensor | None = None  # before / after, once known (None: the mask is applied unscaled)


class SampledStream:
    """One tensor of a randomized task-vector method over row chunks (a :class:`~resumerge.methods.spec.RowStream`)."""

    def __init__(self, samples: Mapping[int, sparsify.Sampled], total: int, *, consensus: bool, rescale: bool) -> None:
        self._samples, self._total = dict(samples), total
        self._consensus, self._rescale = consensus, rescale
        self._drawn: dict[int, _Drawn] = {}
        self._position = 0  # entries of the task vectors seen so far in the current pass

    # Slower than the whole tensor (della on the 1.75 GB bench: 29.6 s streamed, 16.7 s whole; an extra pass of
    # reads, the generator moved on, masks stored and summed in pieces): for tensors that do not fit whole.
    prefer_whole = True

    def held_bytes(self) -> int:
        """The masks kept from the statistics pass to the output pass."""
        return self._total * sum(1 for s in self._samples.values() if sparsify.sampled_draws(s))

    def wants(self, pass_index: int) -> bool:
        """One statistics pass, drawing the masks, when some task vector is sampled at all."""
        return pass_index == 0 and any(sparsify.sampled_draws(s) for s in self._samples.values())

    def observe(self, pass_index: int, ctx: MergeContext) -> None:
        """Draw one chunk's masks and take its norms."""
        base = ctx.base
        if not self._drawn:
            self._start(ctx, base.dtype)
        count = base.numel()
        for index, drawn in self._drawn.items():
            delta = ctx.tensors[index] - base
            mask = sparsify.sampled_mask(delta, self._samples[index], drawn.generator)
            drawn.mask[self._position : self._position + count].copy_(mask.reshape(-1))
            if drawn.norms is not None:
                before, after = drawn.norms
                magnitudes = delta.to(mask.dtype).abs_()
                before.add(magnitudes)
                after.add(magnitudes.mul_(mask))
        self._position += count
        if self._position == self._total:
            self._position = 0
            for drawn in self._drawn.values():
                drawn.ratio = self._ratio(drawn)

    def apply(self, ctx: MergeContext) -> Tensor:
        """The merged rows of the next chunk."""
        count = ctx.base.numel()
        first = self._position

        def sparsify_one(index: int, delta: Tensor) -> Tensor:
            sample = self._samples[index]
            drawn = self._drawn.get(index)
            if drawn is None:  # nothing drawn: kept whole, or (DELLA at density 0) zeroed
                return delta if sample.density >= 1 else delta.zero_()
            work = sparsify.rescale_dtype(delta.dtype)
            values = delta.to(work)  # delta itself, or a fresh copy: ours to overwrite either way
            values.mul_(drawn.mask[first : first + count].view(delta.shape).to(work))
            if drawn.ratio is not None:
                values.mul_(drawn.ratio)
            return values.to(delta.dtype)

        out = combine_task_vectors(ctx, sparsify_one, consensus=self._consensus)
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
            norms = (OrderedSum(self._total, work), OrderedSum(self._total, work)) if self._rescale else None
            self._drawn[index] = _Drawn(own, torch.empty(self._total, dtype=torch.uint8), norms)
            if index != drawing[-1]:  # the words this task vector's mask will take, for the ones after it
                _skip_words(source, self._total)

    @staticmethod
    def _ratio(drawn: _Drawn) -> Tensor | None:
        # The whole-tensor rescale's rule (sparsify._rescaled): unscaled where either norm is below its epsilon.
        if drawn.norms is None:
            return None
        before, after = (norm.result() for norm in drawn.norms)
        if before < sparsify.RESCALE_EPS or after < sparsify.RESCALE_EPS:
            return None
        return before / after


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
    """The :class:`~resumerge.methods.spec.RowStreamFactory` of a randomized task-vector method with these
    defaults (DELLA's ranks run along dim 1, so its tensors need two dimensions or more)."""

    def factory(shape: tuple[int, ...], base_index: int | None, model_params: Sequence[Mapping[str, Any]],
                params: Mapping[str, Any], *, dtype: str | None = None) -> RowStream | None:
        total = math.prod(shape)
        if base_index is None or total == 0 or (della and len(shape) < 2):
            return None
        samples = {}
        for index, p in enumerate(model_params):
            if index == base_index:
                continue
            density = float(p["density"])
            epsilon = float(p["epsilon"]) if della else None
            samples[index] = sparsify.Sampled(density, epsilon)
        # The combine reads `normalize` from each chunk's context; `rescale` decides the statistics pass.
        return SampledStream(samples, total, consensus=consensus, rescale=bool(params["rescale"]))

    return factory
