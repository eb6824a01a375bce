"""Task-vector sparsifiers of the task-arithmetic family: TIES, breadcrumbs, DARE and DELLA masks.

Each function takes one task vector δ (a model minus the base) and returns a tensor of δ's shape and dtype
with some entries zeroed. With ``rescale`` the kept entries are scaled so that the result's L1 norm equals
δ's (not by 1/density: mergekit 0.1.5 matches norms, and so do we). A density of 1 or more disables
sparsification *and* rescaling, and the function may then return δ itself; callers copy it into their own
buffer.

Ranking never sorts a whole tensor: thresholds come from an O(n) selection and masks from comparisons (see
:mod:`resumerge.merge.methods.ranking`). Equal magnitudes competing for the last places are decided by index, as a
stable sort would order them (TIES keeps the lowest indices first). That is the one deliberate difference from
mergekit, which breaks such ties by torch's unstable sort, an order that differs between CPU and GPU; ours is the
same on every device, thread count and row chunking. Without equal magnitudes at a threshold the results are
bit-identical to mergekit's. Ties are rare in float32 (exact zeros aside, which change nothing) and common in
bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.ranking import exact_key_shift, magnitude_keys, stable_order
from resumerge.merge.methods.rankstream import StreamedWindow
from resumerge.merge.methods.summation import OrderedSum

# Below this L1 norm (before or after masking) the masked tensor is returned unscaled, avoiding 0/0.
RESCALE_EPS = 1e-7


def mask_in_place(values: torch.Tensor, mask: torch.Tensor, norms: Norms | None = None,
                  magnitudes: torch.Tensor | None = None) -> None:
    """``values`` × ``mask`` (1/0 of ``values``' dtype and shape) in place; with ``norms`` the L1 norms of
    ``values`` before and after fed to them. ``magnitudes``, when given, is exactly ``values.abs()`` and is
    overwritten: |δ|·m equals |δ·m| for a 1/0 mask, so the norms are the same numbers without a second abs."""
    if norms is None:
        values.mul_(mask)
        return
    counted = values.abs() if magnitudes is None else magnitudes
    norms[0].add(counted)
    values.mul_(mask)
    norms[1].add(counted.mul_(mask))


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    # torch.bernoulli has no float16 CPU kernel, so mergekit draws (and rescales) in float32, except for
    # bfloat16, which it keeps. Drawing from probabilities of the same dtype consumes the generator exactly as
    # mergekit consumes its global RNG, so equally seeded runs give the same masks.
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def rescale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a randomized sparsifier masks and rescales a task vector of ``dtype`` in."""
    # Unlike mergekit on CPU, float64 task vectors are masked and rescaled in float64: rounding them to float32
    # would throw away the precision float64 was chosen for. The masks are unaffected (0 and 1 are exact).
    return torch.float64 if dtype == torch.float64 else _draw_dtype(dtype)


def _require_generator(generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError("a randomized sparsifier needs an explicit torch.Generator (never the global RNG)")
    return generator


def _float32_magnitudes(delta: torch.Tensor) -> torch.Tensor:
    # Magnitudes are compared in float32 whatever delta's dtype (float64 rounds, so its near-equal magnitudes
    # tie), exactly as mergekit ranks them on the CPU.
    return delta.abs().float()


@dataclass(frozen=True)
class Window:
    """Keep the entries at positions ``[start, stop)`` of a stable sort of the magnitudes (descending or not).

    A window is decided by the tensor's size and the method's parameters alone, so the same window applies to a
    whole tensor (:func:`select`) and to its row chunks (:func:`window_of`).
    """

    start: int
    stop: int
    descending: bool


# A selection: keep everything untouched, zero everything (``zero_``, so NaN becomes 0 too), or a rank window.
KEEP: Final = "keep"
ZERO: Final = "zero"
Selection = Window | Literal["keep", "zero"]


def magnitude_selection(numel: int, density: float) -> Selection:
    """What :func:`magnitude` keeps of a tensor of ``numel`` entries."""
    if density >= 1:
        return KEEP
    if density <= 0 or numel == 0:
        return ZERO
    return Window(0, max(1, int(density * numel)), descending=True)


def outlier_selection(numel: int, density: float, gamma: float) -> Selection:
    """What :func:`magnitude_outliers` keeps of a tensor of ``numel`` entries."""
    if density >= 1:
        return KEEP
    keep = int(density * numel)
    skip_small = max(0, numel - keep - int(gamma * numel))
    return Window(skip_small, skip_small + keep, descending=False)


def delta_keys(delta: torch.Tensor) -> torch.Tensor:
    """The integer keys by which the rank windows order ``delta``'s magnitudes (compared in float32)."""
    return magnitude_keys(_float32_magnitudes(delta))


def window_of(selection: Window, total: int, dtype: torch.dtype, *, whole: bool = False) -> StreamedWindow:
    """The :class:`~resumerge.merge.methods.rankstream.StreamedWindow` that finds ``selection`` among the magnitude keys
    (:func:`delta_keys`) of a task vector of ``total`` entries of ``dtype`` arriving in row chunks (``whole``: as
    one chunk)."""
    return StreamedWindow(total, selection.start, selection.stop, descending=selection.descending,
                          shift=exact_key_shift(dtype), whole=whole)


def select(delta: torch.Tensor, selection: Selection, *, rescale: bool, inplace: bool = False,
           keys: torch.Tensor | None = None) -> torch.Tensor:
    """Apply ``selection`` to the whole of ``delta`` as one piece: ``KEEP`` returns ``delta`` itself, ``ZERO``
    zeros, a :class:`Window` masks by rank (the mask is 1/0 in delta's dtype, as mergekit's is, so masked
    negative entries become -0.0 alike), rescaled by the ordered L1 norms with ``rescale``. With ``inplace`` the
    result is written into ``delta``, which is returned. The window is the row chunks' (:func:`window_of`) over
    one chunk: the same masks, found by selection in the piece itself (memory per element, no histograms).
    ``keys``: :func:`delta_keys` of ``delta`` found already (the caller's, never written), else found here."""
    if selection == KEEP:
        return delta
    if selection == ZERO:
        return delta.zero_() if inplace else torch.zeros_like(delta)
    assert isinstance(selection, Window)
    values = delta if inplace else delta.clone()
    ours = keys is None
    keys = delta_keys(values) if keys is None else keys
    mask = window_of(selection, values.numel(), values.dtype, whole=True).mask(keys, values.dtype)
    # float32 keys of our own are a view of |δ| itself, free once the mask is built.
    reusable = keys.view(torch.float32).reshape(values.shape) if ours and values.dtype == torch.float32 else None
    norms = l1_norms(values.numel(), values.dtype, values.device) if rescale else None
    mask_in_place(values, mask.reshape(values.shape), norms, reusable)
    ratio = rescale_ratio(norms)
    return values if ratio is None else values.mul_(ratio)


def magnitude(delta: torch.Tensor, density: float, *, rescale: bool, inplace: bool = False) -> torch.Tensor:
    """Keep the ``k = max(1, ⌊density·N⌋)`` entries of largest magnitude (TIES).

    Magnitudes are compared in float32. Where equal magnitudes straddle the cut, the lowest indices are kept (the
    first ``k`` of a stable descending sort); mergekit keeps whichever its unstable sort puts first. ``density ≤
    0`` (or an empty tensor) gives zeros; ``density ≥ 1`` returns ``delta`` unchanged. With ``inplace`` the result
    is written into ``delta``, which is returned.
    """
    return select(delta, magnitude_selection(delta.numel(), density), rescale=rescale, inplace=inplace)


def magnitude_outliers(
    delta: torch.Tensor, density: float, gamma: float, *, rescale: bool, inplace: bool = False
) -> torch.Tensor:
    """Keep ``⌊density·N⌋`` entries after dropping the largest ``⌊gamma·N⌋`` outliers (model breadcrumbs).

    Sorting magnitudes (in float32) ascending, the kept window starts after the ``max(0, N − ⌊density·N⌋ −
    ⌊gamma·N⌋)`` smallest entries, so fewer outliers are dropped when dropping all of them would undercut
    ``density``. Equal magnitudes at either end of the window are ordered by index, as a stable ascending sort
    orders them: at the lower end the highest indices are kept, at the upper end the lowest. ``density ≥ 1``
    returns ``delta`` unchanged. With ``inplace`` the result is written into ``delta``, which is returned.
    """
    return select(delta, outlier_selection(delta.numel(), density, gamma), rescale=rescale, inplace=inplace)


@dataclass(frozen=True)
class Sampled:
    """A randomized sparsifier's draw for one task vector: DARE's (``epsilon`` None: each entry kept with
    probability ``density``) or DELLA's MAGPRUNE (the keep probability rises linearly with the magnitude's rank
    along dim 1, from density−ε to density+ε)."""

    density: float
    epsilon: float | None = None


def sampled_draws(sampled: Sampled) -> bool:
    """Whether ``sampled`` draws from the generator at all (a density of 1 or more keeps everything, and DELLA's
    of 0 or less zeros everything, without drawing)."""
    if sampled.density >= 1:
        return False
    return sampled.epsilon is None or sampled.density > 0


def sample(delta: torch.Tensor, sampled: Sampled, *, rescale: bool, generator: torch.Generator | None,
           inplace: bool = False, scratch: Scratch | None = None) -> torch.Tensor:
    """Apply DARE's or DELLA's draw (``sampled``) to the whole task vector ``delta``, drawing only from
    ``generator``: :func:`draw_and_mask` over ``delta`` as one piece, then the rescale.

    DARE keeps each entry independently with probability ``density``. DELLA ranks along dim 1 (a 1-D tensor is
    one row): the smallest entry of a row gets density−ε, the largest density+ε; equal magnitudes in a row rank
    by index (lower index, lower rank), where mergekit ranks them by its unstable sort; other ranks, and the
    generator's draws, are the same as mergekit's. A row of one entry gets density (mergekit 0.1.5 divides 0 by
    0 there and fails). ``density ≥ 1`` returns ``delta`` unchanged; DELLA's ``density ≤ 0`` gives zeros without
    drawing. With ``inplace`` ``delta`` may be overwritten (the result is then returned in it where the dtypes
    allow). ``scratch``: the draw's working buffers, reused from an earlier call (see :class:`Scratch`). Raises
    ``ValueError`` when ``generator`` is None or DELLA's density ± ε leaves (0, 1).
    """
    gen = _require_generator(generator)
    if not sampled_draws(sampled):
        if sampled.density >= 1:
            return delta
        return delta.zero_() if inplace else torch.zeros_like(delta)
    values = delta.to(rescale_dtype(delta.dtype))  # delta itself, or a fresh copy of ours
    if values is delta and not inplace:
        values = delta.clone()
    norms = l1_norms(values.numel(), values.dtype, values.device, scratch) if rescale else None
    draw_and_mask(values, sampled, gen, norms=norms, scratch=scratch)
    ratio = rescale_ratio(norms)
    return (values if ratio is None else values.mul_(ratio)).to(delta.dtype)


# L1 norms of a task vector before and after its masking (fed piece by piece: see draw_and_mask).
Norms = tuple[OrderedSum, OrderedSum]


def l1_norms(total: int, dtype: torch.dtype, device: torch.device | str = "cpu", scratch: Scratch | None = None
             ) -> Norms:
    """Empty ordered sums for the L1 norms of a task vector of ``total`` entries of ``dtype``: the order the
    rescale's norms are always summed in, whole or piece by piece. ``scratch``: their waiting numbers are kept in
    its buffers (two sums' at a time: read both results before the next task vector's norms use them)."""
    if scratch is None:
        return OrderedSum(total, dtype, device), OrderedSum(total, dtype, device)
    place = torch.device(device)
    return (OrderedSum(total, dtype, device, lambda count: scratch.take("norm before", count, dtype, place)),
            OrderedSum(total, dtype, device, lambda count: scratch.take("norm after", count, dtype, place)))


def rescale_ratio(norms: Norms | None) -> torch.Tensor | None:
    """The factor that brings the masked L1 norm back to the unmasked one (a 0-dim tensor of the norms' dtype), or
    None: no rescale, or either norm below :data:`RESCALE_EPS` (no 0/0; the mask is applied unscaled)."""
    if norms is None:
        return None
    before, after = (norm.result() for norm in norms)
    if before < RESCALE_EPS or after < RESCALE_EPS:
        return None
    return before / after


def draw_and_mask(values: torch.Tensor, sampled: Sampled, generator: torch.Generator, *, norms: Norms | None = None,
                  keep: torch.Tensor | None = None, scratch: Scratch | None = None) -> None:
    """Draw the keep mask of ``values`` — the next entries of one task vector (whole rows for DELLA), contiguous,
    in :func:`rescale_dtype` and the caller's own buffer — from ``generator`` exactly as one draw over the whole
    task vector continues, and multiply ``values`` by it in place. With ``norms`` the L1 norm of ``values`` before
    and after the masking are fed to them; with ``keep`` (1-D, ``values.numel()`` entries) the 1/0 mask is
    copied into it. ``scratch``: working buffers to reuse (a caller drawing several task vectors or chunks in turn
    passes the same one); without it the call keeps its own for its blocks. Only for a ``sampled`` that draws
    (:func:`sampled_draws`).

    The mask is drawn, applied and counted a block at a time, so it never exists whole and each block's work
    stays in cache; the magnitudes (DELLA's ranks, both norms) are taken a span of blocks at a time into one
    buffer, never as a whole-tensor copy in fresh memory. Consecutive blocks (and consecutive calls on
    consecutive row chunks) consume the generator as one draw over the whole does, every entry meets the same
    operations, and the ordered sums add their pieces in the whole's order, so the bits never depend on where
    the pieces are cut.
    """
    draws = _Draws(values, sampled, generator, Scratch() if scratch is None else scratch)
    flat = values.view(-1)
    counted = norms is not None
    for start, stop in draws.spans():
        magnitudes = draws.magnitudes(start, stop) if counted or draws.ranked else None
        if norms is not None:
            assert magnitudes is not None
            norms[0].add(magnitudes)
        for first, last, mask in draws.masks(start, stop, magnitudes):
            flat[first:last].mul_(mask)
            if norms is not None:
                assert magnitudes is not None
                # |δ|·m is |δ·m| for a 1/0 mask: the norm after masking without a second abs.
                magnitudes[first - start : last - start].mul_(mask)
            if keep is not None:
                keep[first:last].copy_(mask)
        if norms is not None:
            assert magnitudes is not None
            norms[1].add(magnitudes)


class Scratch:
    """Working buffers of the draws, one per use, each grown to the largest asked and lent again to the next
    block, task vector or chunk. A block's int64 sort keys (1 MiB) or a span's magnitudes (4 MiB) lie above the
    allocator's mmap threshold (:mod:`resumerge.machine.memory.allocator`), so a fresh one per block was mapped anew and
    its pages zeroed by the kernel at first touch: that cost about as much as the block's sort. Used by one thread
    at a time; what one use lends is valid until that use is asked again."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def take(self, use: str, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D tensor of ``count`` entries of ``dtype`` on ``device``: ``use``'s buffer."""
        held = self._held.get(use)
        if held is None or held.numel() < count or held.dtype != dtype or held.device != device:
            del held  # freed before its larger successor is allocated
            held = self._held[use] = torch.empty(count, dtype=dtype, device=device)
        return held[:count]

    def clear(self) -> None:
        """Drop every buffer (the next :meth:`take` allocates afresh)."""
        self._held.clear()


class _Draws:
    """One call's draw over ``values``: its spans of blocks, their magnitudes in one reused buffer, and each
    block's 1/0 mask (in ``values``' dtype) drawn from the generator in order. On the CPU a mask block holds
    about :data:`_ROW_BLOCK_ELEMENTS` entries (whole rows for DELLA) and a span about
    :data:`_SPAN_ELEMENTS` (whole blocks); elsewhere one block is the whole, as a draw cannot be split there
    (torch.bernoulli)."""

    def __init__(self, values: torch.Tensor, sampled: Sampled, generator: torch.Generator, scratch: Scratch) -> None:
        self.generator = generator
        self.scratch = scratch
        self.flat = values.view(-1)
        self.work = values.dtype
        self.draw = _draw_dtype(self.work)
        self.ranked = sampled.epsilon is not None
        count = values.numel()
        cpu = values.device.type == "cpu"
        # DELLA ranks rows along dim 1 (a 1-D tensor is one row); DARE's blocks are flat entries.
        self.rows = (values.shape if values.dim() >= 2 else (1, count)) if self.ranked else (count, 1)
        self.inner = count // self.rows[0] if count else 1
        self.step = max(1, _ROW_BLOCK_ELEMENTS // self.inner) if cpu else max(1, self.rows[0])  # rows a block
        self.span = self.step * max(1, _SPAN_ELEMENTS // (self.step * self.inner)) if cpu else self.step
        if self.ranked:
            assert sampled.epsilon is not None
            _check_epsilon(sampled.density, sampled.epsilon)
            if count:
                self.table = _probability_table(self.rows[1], sampled.density, sampled.epsilon, self.draw,
                                                values.device)
        else:
            # The probability is rounded to the draw dtype, so bfloat16 keeps bfloat16's rounding of density;
            # expanded, not filled, as the CPU draw only compares against it.
            self.probability = torch.tensor(sampled.density, dtype=self.draw, device=values.device)

    def spans(self) -> Iterator[tuple[int, int]]:
        """The flat ranges [start, stop) whose magnitudes are taken at once, first to last."""
        total = self.rows[0] if self.flat.numel() else 0
        for first in range(0, total, self.span):
            yield first * self.inner, min(total, first + self.span) * self.inner

    def magnitudes(self, start: int, stop: int) -> torch.Tensor:
        """|values| of the flat entries [start, stop) (a span), in a buffer the next span overwrites."""
        buffer = self.scratch.take("magnitudes", stop - start, self.work, self.flat.device)
        return torch.abs(self.flat[start:stop], out=buffer)

    def masks(self, start: int, stop: int, magnitudes: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first, last, 1/0 mask of the flat entries [first, last)) for the blocks of the span [start, stop),
        drawn in order; DELLA ranks each block's rows by ``magnitudes`` (the span's, unmasked until its mask
        has been drawn)."""
        block = self.step * self.inner
        for first in range(start, stop, block):
            last = min(stop, first + block)
            uniform = None
            if self.ranked:
                assert magnitudes is not None
                # Ranking compares the magnitudes in the values' dtype: the task vector's own, or (float16) its
                # exact float32. A float64 mask is a copy of the draws beside them, so float64 keeps no buffer
                # across blocks (the memory it is reserved is what each block's own take at once).
                rows = magnitudes[first - start : last - start].view(-1, *self.rows[1:])
                lent = None if self.work == torch.float64 else self.scratch
                probabilities = _rank_probabilities(rows, self.table, self.draw, lent)
                if lent is not None and self.flat.device.type == "cpu":  # the draws go where the order was
                    uniform = self.scratch.take("order", last - first, torch.int64, self.flat.device)
                    uniform = uniform.view(torch.float32)[: last - first]
            else:
                probabilities = self.probability.expand(last - first)
                if self.flat.device.type == "cpu":
                    uniform = self.scratch.take("uniform", last - first, torch.float32, self.flat.device)
            yield first, last, bernoulli_mask(probabilities, self.generator, self.work, uniform).reshape(-1)


def bernoulli_mask(probabilities: torch.Tensor, generator: torch.Generator, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``torch.bernoulli(probabilities, generator=generator).to(dtype)``, bit for bit, a third of the time.

    ``probabilities`` is float32 or bfloat16 (contiguous or expanded). The generator advances exactly as
    ``torch.bernoulli`` advances it, so later draws are unchanged too. ``out``: a float32 CPU buffer of
    ``probabilities.numel()`` entries the draws are made in (the result may be it).
    """
    if probabilities.device.type != "cpu":
        return torch.bernoulli(probabilities.contiguous(), generator=generator).to(dtype)
    # On the CPU, torch.bernoulli with a float32/bfloat16 probability tensor draws one 32-bit word per entry, in
    # the order of its contiguous output, turns its low 24 bits into u = k/2²⁴ and keeps the entry when u < p;
    # uniform_ on float32 draws the same words in the same order and builds the same u, and a comparison in
    # place writes the 1/0 mask without bernoulli's per-entry distribution object
    # (tests/methods/test_fast_kernels.py pins the equality for the installed torch).
    uniform = torch.empty(probabilities.shape, dtype=torch.float32) if out is None else out.view(probabilities.shape)
    return uniform.uniform_(generator=generator).lt_(probabilities).to(dtype)


def _check_epsilon(density: float, epsilon: float) -> None:
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise ValueError("Epsilon must be chosen such that density +/- epsilon is in (0, 1)")


# Entries per block of a draw (whole rows for DELLA): the block's int64 sort keys and probabilities stay in cache.
_ROW_BLOCK_ELEMENTS = 1 << 17
# Entries (whole blocks) whose magnitudes are taken at once: the norms' ordered sums fold a piece in a few dozen
# small kernels whatever its size, so spans of about this many (4 MiB of float32, in the last-level cache) keep
# that cost a small part, where a whole tensor's magnitudes took fresh memory the size of the task vector.
_SPAN_ELEMENTS = 1 << 20


def _probability_table(n: int, density: float, epsilon: float, draw: torch.dtype, device: torch.device) -> torch.Tensor:
    # The keep probability of each 0-based rank in a row of n, in the draw dtype. 1-based ranks are converted to
    # the draw dtype, as mergekit converts them (in bfloat16 large ranks round, which changes probabilities
    # slightly); each row's are a permutation of 1..n, so its lowest and highest are the conversions of 1 and n,
    # computed by the same operations as every other rank (mergekit's per-row min/max).
    ranks = torch.arange(n, dtype=torch.int32, device=device).to(draw).add_(1)
    low, high = ranks[0].clone(), ranks[-1].clone()
    # mergekit's expression, evaluated in place in the same order: ((r − low)/(high − low)).clamp(0, 1)·2·ε
    # + (density − ε), each step rounded to the draw dtype exactly as there.
    spread = ranks.fill_(0.5) if n == 1 else ranks.sub_(low).div_(high - low).clamp_(0, 1)
    return spread.mul_(2).mul_(epsilon).add_(density - epsilon)


def _rank_probabilities(magnitudes: torch.Tensor, table: torch.Tensor, draw: torch.dtype,
                        scratch: Scratch | None = None) -> torch.Tensor:
    # Keep probabilities by rank along dim 1 (a tensor of two or more dims; the other dims index rows), in the
    # draw dtype. A probability depends on the rank alone, so mergekit's expression is evaluated once per rank
    # (the `table`) and scattered through each row's stable order: one pass over the block where ranking,
    # converting and six elementwise steps took eight.
    moved = magnitudes.movedim(1, -1)
    n = moved.shape[-1]
    # bfloat16's keys rank as int32 packed keys, float32's as int64 (31 bits of key and the column's).
    count, device = moved.numel(), magnitudes.device
    lent = scratch if device.type == "cpu" else None
    order = stable_order(magnitude_keys(moved).reshape(-1, n), exact_key_shift(magnitudes.dtype),
                         None if lent is None else lent.take("order", count, torch.int64, device))
    probabilities = (torch.empty(order.shape, dtype=draw, device=device) if lent is None
                     else lent.take("probabilities", count, draw, device).view(order.shape))
    probabilities.scatter_(1, order, table.expand(order.shape))
    return probabilities.reshape(moved.shape).movedim(-1, 1)
