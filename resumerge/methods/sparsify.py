"""Task-vector sparsifiers of the task-arithmetic family: TIES, breadcrumbs, DARE and DELLA masks.

Each function takes one task vector δ (a model minus the base) and returns a tensor of δ's shape and dtype
with some entries zeroed. With ``rescale`` the kept entries are scaled so that the result's L1 norm equals
δ's (not by 1/density: mergekit 0.1.5 matches norms, and so do we). A density of 1 or more disables
sparsification *and* rescaling, and the function may then return δ itself; callers copy it into their own
buffer.

Ties in magnitude are broken by torch's default (unstable) sort, exactly as mergekit calls it; on CPU that
order is deterministic for a given torch build and independent of the thread count, which makes TIES and
breadcrumbs bit-identical to mergekit even in bfloat16, where equal magnitudes are common.
"""

from __future__ import annotations

import torch

# Below this L1 norm (before or after masking) the masked tensor is returned unscaled, avoiding 0/0.
_RESCALE_EPS = 1e-7


def _mask_and_rescale(delta: torch.Tensor, mask: torch.Tensor, rescale: bool) -> torch.Tensor:
    masked = delta * mask
    if not rescale:
        return masked
    before = delta.abs().sum()
    after = masked.abs().sum()
    if before < _RESCALE_EPS or after < _RESCALE_EPS:
        return masked
    return masked * (before / after)


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    # torch.bernoulli has no float16 CPU kernel, so mergekit draws (and rescales) in float32, except for
    # bfloat16, which it keeps. Drawing from probabilities of the same dtype consumes the generator exactly as
    # mergekit consumes its global RNG, so equally seeded runs give the same masks.
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _rescale_dtype(dtype: torch.dtype) -> torch.dtype:
    # Unlike mergekit on CPU, float64 task vectors are masked and rescaled in float64: rounding them to float32
    # would throw away the precision float64 was chosen for. The masks are unaffected (0 and 1 are exact).
    return torch.float64 if dtype == torch.float64 else _draw_dtype(dtype)


def _require_generator(generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError("a randomized sparsifier needs an explicit torch.Generator (never the global RNG)")
    return generator


def magnitude(delta: torch.Tensor, density: float, *, rescale: bool) -> torch.Tensor:
    """Keep the ``k = max(1, ⌊density·N⌋)`` entries of largest magnitude (TIES).

    ``density ≤ 0`` (or an empty tensor) gives zeros; ``density ≥ 1`` returns ``delta`` unchanged.
    """
    if density >= 1:
        return delta
    if density <= 0 or delta.numel() == 0:
        return torch.zeros_like(delta)
    keep = max(1, int(density * delta.numel()))
    # Magnitudes are ranked in float32 on CPU, as in mergekit (sorting half types there is slow).
    order = torch.argsort(delta.abs().reshape(-1).float(), descending=True)
    mask = torch.zeros(delta.numel(), dtype=delta.dtype, device=delta.device)
    mask[order[:keep]] = 1
    return _mask_and_rescale(delta, mask.reshape_as(delta), rescale)


def magnitude_outliers(delta: torch.Tensor, density: float, gamma: float, *, rescale: bool) -> torch.Tensor:
    """Keep ``⌊density·N⌋`` entries after dropping the largest ``⌊gamma·N⌋`` outliers (model breadcrumbs).

    Sorting magnitudes ascending, the kept window starts after the ``max(0, N − ⌊density·N⌋ − ⌊gamma·N⌋)``
    smallest entries, so fewer outliers are dropped when dropping all of them would undercut ``density``.
    ``density ≥ 1`` returns ``delta`` unchanged.
    """
    if density >= 1:
        return delta
    total = delta.numel()
    keep = int(density * total)
    skip_small = max(0, total - keep - int(gamma * total))
    order = torch.sort(delta.abs().reshape(-1).float(), descending=False).indices
    mask = torch.zeros(total, dtype=delta.dtype, device=delta.device)
    mask[order[skip_small : skip_small + keep]] = 1
    return _mask_and_rescale(delta, mask.reshape_as(delta), rescale)


def bernoulli(delta: torch.Tensor, density: float, *, rescale: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Keep each entry independently with probability ``density`` (DARE), drawing only from ``generator``.

    ``density ≥ 1`` returns ``delta`` unchanged. Raises ``ValueError`` when ``generator`` is None.
    """
    gen = _require_generator(generator)
    if density >= 1:
        return delta
    # The probability is materialised in the draw dtype, so bfloat16 keeps bfloat16's rounding of density.
    mask = torch.bernoulli(torch.full_like(delta, density, dtype=_draw_dtype(delta.dtype)), generator=gen)
    work = _rescale_dtype(delta.dtype)
    return _mask_and_rescale(delta.to(work), mask.to(work), rescale).to(delta.dtype)


def della_magprune(
    delta: torch.Tensor,
    density: float,
    epsilon: float,
    *,
    rescale: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """DELLA's MAGPRUNE: keep probability rises linearly with magnitude rank from density−ε to density+ε.

    Ranks are taken along dim 1 (1-D tensors are one row); the smallest entry of a row gets density−ε, the
    largest density+ε. A row of one entry gets density (mergekit 0.1.5 divides 0 by 0 there and fails).
    ``density ≥ 1`` returns ``delta`` unchanged; ``density ≤ 0`` gives zeros. Raises ``ValueError`` when
    density ± ε leaves (0, 1) or when ``generator`` is None.
    """
    gen = _require_generator(generator)
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise ValueError("Epsilon must be chosen such that density +/- epsilon is in (0, 1)")
    shape = delta.shape
    rows = delta.reshape(1, -1) if delta.dim() < 2 else delta
    draw = _draw_dtype(delta.dtype)
    # Ranking uses the magnitudes in delta's own dtype, and 1-based ranks are converted to the draw dtype,
    # both as mergekit does (in bfloat16 large ranks round, which changes probabilities slightly).
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1), dim=1).to(draw) + 1
    low = ranks.min(dim=1, keepdim=True).values
    high = ranks.max(dim=1, keepdim=True).values
    single = rows.shape[1] == 1
    spread = torch.full_like(ranks, 0.5) if single else ((ranks - low) / (high - low)).clamp(0, 1)
    probabilities = (density - epsilon) + spread * 2 * epsilon
    work = _rescale_dtype(delta.dtype)
    mask = torch.bernoulli(probabilities, generator=gen).to(work)
    return _mask_and_rescale(rows.to(work), mask, rescale).to(delta.dtype).reshape(shape)
