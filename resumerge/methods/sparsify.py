"""Task-vector sparsifiers of the task-arithmetic family: TIES, breadcrumbs, DARE and DELLA masks.

Each function takes one task vector δ (a model minus the base) and returns a tensor of δ's shape and dtype
with some entries zeroed. With ``rescale`` the kept entries are scaled so that the result's L1 norm equals
δ's (not by 1/density: mergekit 0.1.5 matches norms, and so do we). A density of 1 or more disables
sparsification *and* rescaling, and the function may then return δ itself; callers copy it into their own
buffer.

Ranking never sorts a whole tensor: thresholds come from an O(n) selection and masks from comparisons (see
:mod:`resumerge.methods.ranking`). Equal magnitudes competing for the last places are decided by index, as a
stable sort would order them (TIES keeps the lowest indices first). That is the one deliberate difference from
mergekit, which breaks such ties by torch's unstable sort, an order that differs between CPU and GPU; ours is the
same on every device, thread count and row chunking. Without equal magnitudes at a threshold the results are
bit-identical to mergekit's. Ties are rare in float32 (exact zeros aside, which change nothing) and common in
bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from resumerge.methods.ranking import magnitude_keys, rank_window, stable_order
from resumerge.methods.summation import ordered_sum
from resumerge.torch_import import torch

# Below this L1 norm (before or after masking) the masked tensor is returned unscaled, avoiding 0/0.
RESCALE_EPS = 1e-7


def _mask_and_rescale(
    delta: torch.Tensor,
    mask: torch.Tensor,
    rescale: bool,
    inplace: bool = False,
    magnitudes: torch.Tensor | None = None,
) -> torch.Tensor:
    # `magnitudes`, when given, is exactly delta.abs() (same dtype and shape) and may be overwritten: it saves
    # both abs passes, and |δ|·m equals |δ·m| for a 0/1 mask, so the norms are the same numbers. The norm before
    # masking is taken first, so that masking may overwrite delta. Both norms are ordered sums
    # (resumerge.methods.summation): the same bits for any thread count or device, and from row chunks
    # (resumerge.methods.sample_stream).
    before = ordered_sum(delta.abs() if magnitudes is None else magnitudes) if rescale else None
    masked = delta.mul_(mask) if inplace else delta * mask
    if before is None:
        return masked
    after = ordered_sum(masked.abs() if magnitudes is None else magnitudes.mul_(mask))
    return _rescaled(masked, before, after)  # `masked` is delta itself or a fresh product: ours to scale


def _rescaled(masked: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    # `masked` scaled in place so that its L1 norm `after` becomes `before`, the norm before masking; unscaled
    # when either is below RESCALE_EPS (no 0/0).
    if before < RESCALE_EPS or after < RESCALE_EPS:
        return masked
    return masked.mul_(before / after)


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
    whole tensor (:func:`select`) and to its row chunks (:mod:`resumerge.methods.rankstream`).
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


def select(delta: torch.Tensor, selection: Selection, *, rescale: bool, inplace: bool = False) -> torch.Tensor:
    """Apply ``selection`` to the whole of ``delta``: ``KEEP`` returns ``delta`` itself, ``ZERO`` zeros, a
    :class:`Window` masks by rank (the mask is 1/0 in delta's dtype, as mergekit's is, so masked negative entries
    become -0.0 alike). With ``inplace`` the result is written into ``delta``, which is returned."""
    if selection == KEEP:
        return delta
    if selection == ZERO:
        return delta.zero_() if inplace else torch.zeros_like(delta)
    assert isinstance(selection, Window)
    magnitudes = _float32_magnitudes(delta)
    keys = magnitude_keys(magnitudes)
    mask = rank_window(keys, selection.start, selection.stop, descending=selection.descending, dtype=delta.dtype)
    reusable = magnitudes if delta.dtype == torch.float32 else None  # otherwise not delta.abs() itself
    return _mask_and_rescale(delta, mask.reshape(delta.shape), rescale, inplace, reusable)


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


def bernoulli(
    delta: torch.Tensor, density: float, *, rescale: bool, generator: torch.Generator | None, inplace: bool = False
) -> torch.Tensor:
    """Keep each entry independently with probability ``density`` (DARE), drawing only from ``generator``.

    ``density ≥ 1`` returns ``delta`` unchanged. With ``inplace`` ``delta`` may be overwritten (the result is then
    returned in it where the dtypes allow). Raises ``ValueError`` when ``generator`` is None.
    """
    gen = _require_generator(generator)
    if density >= 1:
        return delta
    if delta.dtype == torch.float32 and delta.device.type == "cpu" and delta.is_contiguous():
        return _bernoulli_in_blocks(delta if inplace else delta.clone(), density, rescale, gen)
    work = rescale_dtype(delta.dtype)
    mask = _dare_mask(delta, density, gen)
    values = delta.to(work)
    converted = values is not delta  # then `values` is a fresh copy, ours to overwrite
    magnitudes = values.abs() if rescale else None
    masked = _mask_and_rescale(values, mask, rescale, inplace or converted, magnitudes)
    return masked.to(delta.dtype)


def _dare_mask(delta: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    # DARE's 1/0 mask for delta's entries, in rescale_dtype. The probability is rounded to the draw dtype, so
    # bfloat16 keeps bfloat16's rounding of density; expanded, not filled, as the CPU draw only compares against it.
    probability = torch.tensor(density, dtype=_draw_dtype(delta.dtype), device=delta.device)
    return bernoulli_mask(probability.expand(delta.shape), gen, rescale_dtype(delta.dtype))


def _bernoulli_in_blocks(values: torch.Tensor, density: float, rescale: bool, gen: torch.Generator) -> torch.Tensor:
    # The float32 CPU case of bernoulli, in place in the contiguous `values`: each block's mask is drawn into a
    # scratch block and applied (to the values and, for the rescale, to their magnitudes) while in cache, so the
    # whole mask never exists. The draws consume the generator block after block as one draw over the tensor
    # does, and the two L1 norms are the same ordered sums as in _mask_and_rescale: the same bits.
    flat = values.view(-1)
    if flat.numel() == 0:
        return values
    magnitudes = flat.abs() if rescale else None
    before = ordered_sum(magnitudes) if magnitudes is not None else None
    probability = torch.tensor(density, dtype=torch.float32)
    step = min(_ROW_BLOCK_ELEMENTS, flat.numel())
    scratch = torch.empty(step, dtype=torch.float32)
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        mask = scratch[: part.numel()].uniform_(generator=gen).lt_(probability)
        part.mul_(mask)
        if magnitudes is not None:
            magnitudes[start : start + step].mul_(mask)
    if magnitudes is None or before is None:
        return values
    return _rescaled(values, before, ordered_sum(magnitudes))


def bernoulli_mask(probabilities: torch.Tensor, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Return ``torch.bernoulli(probabilities, generator=generator).to(dtype)``, bit for bit, a third of the time.

    ``probabilities`` is float32 or bfloat16 (contiguous or expanded). The generator advances exactly as
    ``torch.bernoulli`` advances it, so later draws are unchanged too.
    """
    if probabilities.device.type != "cpu":
        return torch.bernoulli(probabilities.contiguous(), generator=generator).to(dtype)
    # On the CPU, torch.bernoulli with a float32/bfloat16 probability tensor draws one 32-bit word per entry, in
    # the order of its contiguous output, turns its low 24 bits into u = k/2²⁴ and keeps the entry when u < p;
    # uniform_ on float32 draws the same words in the same order and builds the same u, and a comparison in
    # place writes the 1/0 mask without bernoulli's per-entry distribution object
    # (tests/methods/test_fast_kernels.py pins the equality for the installed torch).
    uniform = torch.empty(probabilities.shape, dtype=torch.float32).uniform_(generator=generator)
    return uniform.lt_(probabilities).to(dtype)


def della_magprune(
    delta: torch.Tensor,
    density: float,
    epsilon: float,
    *,
    rescale: bool,
    generator: torch.Generator | None,
    inplace: bool = False,
) -> torch.Tensor:
    """DELLA's MAGPRUNE: keep probability rises linearly with magnitude rank from density−ε to density+ε.

    Ranks are taken along dim 1 (1-D tensors are one row); the smallest entry of a row gets density−ε, the
    largest density+ε. Equal magnitudes in a row rank by index (lower index, lower rank), where mergekit ranks
    them by its unstable sort; other ranks, and the generator's draws, are the same as mergekit's. A row of one
    entry gets density (mergekit 0.1.5 divides 0 by 0 there and fails).
    ``density ≥ 1`` returns ``delta`` unchanged; ``density ≤ 0`` gives zeros. With ``inplace`` ``delta`` may be
    overwritten (the result is then returned in it where the dtypes allow). Raises ``ValueError`` when
    density ± ε leaves (0, 1) or when ``generator`` is None.
    """
    gen = _require_generator(generator)
    if density >= 1:
        return delta
    if density <= 0:
        return delta.zero_() if inplace else torch.zeros_like(delta)
    _check_epsilon(density, epsilon)
    shape = delta.shape
    rows = delta.reshape(1, -1) if delta.dim() < 2 else delta
    draw = _draw_dtype(delta.dtype)
    # Ranking compares the magnitudes in delta's own dtype, as mergekit does.
    magnitudes = rows.abs()
    work = rescale_dtype(delta.dtype)
    if rows.dim() == 2 and rows.device.type == "cpu" and delta.dtype == work == draw == torch.float32:
        return _mask_rows_in_blocks(rows if inplace else rows.clone(), magnitudes, density, epsilon, rescale,
                                    gen).reshape(shape)
    mask = _della_mask(magnitudes, density, epsilon, draw, work, gen)
    values = rows.to(work)
    converted = work != delta.dtype  # then `values` is a fresh copy, ours to overwrite
    reusable = None if converted else magnitudes
    masked = _mask_and_rescale(values, mask, rescale, inplace or converted, reusable)
    return masked.to(delta.dtype).reshape(shape)


def _check_epsilon(density: float, epsilon: float) -> None:
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise ValueError("Epsilon must be chosen such that density +/- epsilon is in (0, 1)")


def _della_mask(magnitudes: torch.Tensor, density: float, epsilon: float, draw: torch.dtype, work: torch.dtype,
                gen: torch.Generator) -> torch.Tensor:
    # MAGPRUNE's 1/0 mask (dtype `work`) from the magnitudes of whole rows (two or more dims; ranks along dim 1).
    if magnitudes.dim() == 2 and magnitudes.device.type == "cpu":
        return _row_block_mask(magnitudes, density, epsilon, draw, work, gen)
    return bernoulli_mask(_rank_probabilities(magnitudes, density, epsilon, draw), gen, work)


# Elements per block of rows in _row_block_mask: the block's int64 sort keys and probabilities stay in cache.
_ROW_BLOCK_ELEMENTS = 1 << 17


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


def _row_block_mask(
    magnitudes: torch.Tensor, density: float, epsilon: float, draw: torch.dtype, work: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    # bernoulli_mask(_rank_probabilities(...)) for a contiguous 2-D CPU tensor, a block of whole rows at a time:
    # ranks are per row, and the draws of consecutive blocks consume the generator in the order one draw over
    # the whole tensor does, so the mask is the same while the sort keys and probabilities (three tensors'
    # worth at once) stay block-sized.
    rows, n = magnitudes.shape
    mask = torch.empty(magnitudes.shape, dtype=work)
    if mask.numel() == 0:
        return mask
    table = _probability_table(n, density, epsilon, draw, magnitudes.device)
    step = max(1, _ROW_BLOCK_ELEMENTS // n)
    for start in range(0, rows, step):
        order = stable_order(magnitude_keys(magnitudes[start : start + step]))
        probabilities = torch.empty(order.shape, dtype=draw).scatter_(1, order, table.expand(order.shape))
        mask[start : start + step] = bernoulli_mask(probabilities, gen, work)
    return mask


def _mask_rows_in_blocks(
    rows: torch.Tensor, magnitudes: torch.Tensor, density: float, epsilon: float, rescale: bool,
    gen: torch.Generator,
) -> torch.Tensor:
    # The float32 CPU case of della_magprune, in place in `rows`: _row_block_mask and _mask_and_rescale fused,
    # so each block's mask is applied while it is in cache and never exists whole (a tensor-size less memory,
    # and two whole-tensor passes fewer). `magnitudes` is rows.abs(), overwritten. Every entry meets the same
    # operations as there and the two L1 norms are the same ordered sums, so the bits are the same.
    n = rows.shape[1]
    if rows.numel() == 0:
        return rows
    before = ordered_sum(magnitudes) if rescale else None
    table = _probability_table(n, density, epsilon, torch.float32, rows.device)
    step = max(1, _ROW_BLOCK_ELEMENTS // n)
    scratch = torch.empty(min(step, rows.shape[0]) * n, dtype=torch.float32)
    for start in range(0, rows.shape[0], step):
        block = magnitudes[start : start + step]
        order = stable_order(magnitude_keys(block))
        probabilities = torch.empty(order.shape, dtype=torch.float32).scatter_(1, order, table.expand(order.shape))
        del order
        mask = scratch[: probabilities.numel()].view(probabilities.shape)
        # bernoulli_mask's draw and comparison, in the scratch block.
        mask.uniform_(generator=gen).lt_(probabilities)
        rows[start : start + step].mul_(mask)
        if before is not None:
            block.mul_(mask)
    return rows if before is None else _rescaled(rows, before, ordered_sum(magnitudes))


def _rank_probabilities(
    magnitudes: torch.Tensor, density: float, epsilon: float, draw: torch.dtype
) -> torch.Tensor:
    # Keep probabilities by rank along dim 1 (a tensor of two or more dims; the other dims index rows), in the
    # draw dtype. A probability depends on the rank alone, so mergekit's expression is evaluated once per rank
    # (a table of n entries) and scattered through each row's stable order: one pass over the tensor where
    # ranking, converting and six elementwise steps took eight.
    moved = magnitudes.movedim(1, -1)
    n = moved.shape[-1]
    if moved.numel() == 0:
        return torch.empty(magnitudes.shape, dtype=draw, device=magnitudes.device)
    order = stable_order(magnitude_keys(moved).reshape(-1, n))
    table = _probability_table(n, density, epsilon, draw, magnitudes.device)
    probabilities = torch.empty(order.shape, dtype=draw, device=magnitudes.device)
    probabilities.scatter_(1, order, table.expand(order.shape))
    return probabilities.reshape(moved.shape).movedim(-1, 1)


@dataclass(frozen=True)
class Sampled:
    """A randomized sparsifier's draw for one task vector: DARE's (``epsilon`` None) or DELLA's MAGPRUNE.

    :func:`sampled_mask` draws its masks for consecutive parts of a task vector (row chunks, first rows first)
    exactly as :func:`bernoulli` and :func:`della_magprune` draw them for the whole, consuming the generator the
    same way; :mod:`resumerge.methods.sample_stream` builds their row-chunk form on it.
    """

    density: float
    epsilon: float | None = None


def sampled_draws(sampled: Sampled) -> bool:
    """Whether ``sampled`` draws from the generator at all (a density of 1 or more keeps everything, and DELLA's
    of 0 or less zeros everything, without drawing)."""
    if sampled.density >= 1:
        return False
    return sampled.epsilon is None or sampled.density > 0


def sampled_mask(delta: torch.Tensor, sampled: Sampled, generator: torch.Generator) -> torch.Tensor:
    """The 1/0 keep mask (dtype :func:`rescale_dtype`) of the next entries of a task vector, ``delta`` holding
    them in its shape (whole rows for DELLA, which ranks along dim 1), drawn from ``generator`` as the
    whole-tensor sparsifier draws them. Only for a ``sampled`` that draws (:func:`sampled_draws`)."""
    if sampled.epsilon is None:
        return _dare_mask(delta, sampled.density, generator)
    _check_epsilon(sampled.density, sampled.epsilon)
    return _della_mask(delta.abs(), sampled.density, sampled.epsilon, _draw_dtype(delta.dtype),
                       rescale_dtype(delta.dtype), generator)
