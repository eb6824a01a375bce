"""The generalized task-arithmetic family: ``task_arithmetic``, ``ties``, ``dare_ties``, ``dare_linear``,
``breadcrumbs``, ``breadcrumbs_ties``, ``della`` and ``della_linear``.

All eight are one computation with two switches, as in mergekit 0.1.5: an optional sparsifier applied to each
task vector δᵢ = θᵢ − B (see :mod:`resumerge.merge.methods.sparsify`), and an optional TIES sign election (see
:mod:`resumerge.merge.methods.consensus`). Every step runs in the inputs' dtype, which is what makes the results
bit-identical to mergekit for the deterministic members. Each sparsified member is defined once, by its row
stream (``ties`` and ``breadcrumbs(_ties)``: :mod:`resumerge.merge.methods.task_stream`; the DARE and DELLA pairs:
:mod:`resumerge.merge.methods.sample_stream`), and its whole-tensor function is that stream over one chunk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods import sparsify
from resumerge.merge.methods.footprint import MethodFootprint, measured, row_block_scratch
from resumerge.merge.methods.sample_stream import sampled_stream
from resumerge.merge.methods.spec import (
    BasePolicy,
    MergeContext,
    MethodSpec,
    ParamSpec,
    RowSelection,
    RowStreamFactory,
    Scope,
    one_chunk,
)
from resumerge.merge.methods.task_stream import (
    TASK_KEY_COUNTS,
    TASK_KEYS,
    magnitude_selector,
    outlier_selector,
    task_vector_rows,
    task_vector_stream,
)
from resumerge.merge.methods.task_vectors import TASK_VECTOR, combine_task_vectors


def merge_task_vectors(ctx: MergeContext) -> torch.Tensor:
    """``task_arithmetic``: B + λ·Σ wᵢ·δᵢ / D in the base's dtype, δᵢ = θᵢ − B.

    The sparsified members are the same sum over sparsified task vectors, with a TIES sign-agreement mask mᵢ
    (``consensus``) where they elect signs: with ``normalize`` the divisor ``D`` is Σ wᵢ·mᵢ per position (a zero
    divisor becomes 1) or, without consensus, Σ wᵢ (treated as 1 when ``|Σ wᵢ| < 1e-8``); otherwise ``D = 1``.
    ``normalize`` and ``lambda`` come from ``ctx.params`` (the method's defaults bound there). Their sparsifiers
    are streams (:mod:`resumerge.merge.methods.task_stream`, :mod:`resumerge.merge.methods.sample_stream`), and their
    whole-tensor function is the stream over one chunk. The rank-based sparsifiers (TIES, breadcrumbs, DELLA)
    decide between equal magnitudes at their threshold by index, where mergekit follows its unstable sort: the
    one deliberate difference from mergekit (see :mod:`resumerge.merge.methods.sparsify`). Without non-base inputs the
    result is a copy of the base. Raises ``ValueError`` without a base.
    """
    return combine_task_vectors(ctx, None, consensus=False)


def check_della_epsilon(params: Mapping[str, Any], model_params: Sequence[Mapping[str, Any]]) -> str | None:
    """Reject a model whose 0 < density < 1 puts density ± epsilon outside (0, 1) (mergekit fails late)."""
    for p in model_params:
        if "density" not in p and "epsilon" not in p:
            continue  # the base: DELLA's per-model parameters are never resolved for it
        density, epsilon = float(p["density"]), float(p["epsilon"])
        if 0 < density < 1 and (density + epsilon >= 1 or density - epsilon <= 0):
            return (
                f"DELLA needs density ± epsilon inside (0, 1), but density {density:g} with epsilon "
                f"{epsilon:g} gives [{density - epsilon:g}, {density + epsilon:g}]; "
                "lower epsilon or move density inward."
            )
    return None


@dataclass(frozen=True)
class _Variant:
    name: str
    sparsifier: str | None  # mergekit's SparsificationMethod name
    consensus: bool
    normalize: bool
    rescale: bool
    reference: str
    footprint: MethodFootprint
    title: str  # the model card's name and one-line description
    summary: str


def _params(variant: _Variant) -> tuple[ParamSpec, ...]:
    # Density is declared (and ignored) by plain task_arithmetic too, as in mergekit, so configs carrying it
    # still validate; it is only bounded where a sparsifier reads it.
    bounded = variant.sparsifier is not None
    specs = [
        ParamSpec("int8_mask", Scope.GLOBAL, bool, default=False),
        ParamSpec("normalize", Scope.GLOBAL, bool, default=variant.normalize),
        ParamSpec("rescale", Scope.GLOBAL, bool, default=variant.rescale),
        ParamSpec("lambda", Scope.GLOBAL, float, default=1.0),
        ParamSpec("weight", Scope.NON_BASE, float, required=True),
        ParamSpec(
            "density",
            Scope.NON_BASE,
            float,
            default=1.0,
            minimum=0.0 if bounded else None,
            maximum=1.0 if bounded else None,
        ),
    ]
    if variant.sparsifier == "magnitude_outliers":
        specs.append(ParamSpec("gamma", Scope.NON_BASE, float, default=0.01, minimum=0.0, maximum=1.0))
    if variant.sparsifier == "della_magprune":
        specs.append(ParamSpec("epsilon", Scope.NON_BASE, float, default=0.15, minimum=0.0))
    return tuple(specs)


# Every sparsifier also runs over row chunks: the deterministic rank windows in resumerge.merge.methods.task_stream,
# the randomized draws in resumerge.merge.methods.sample_stream.
_SELECTORS = MappingProxyType({"magnitude": magnitude_selector, "magnitude_outliers": outlier_selector})


def _streamed(variant: _Variant) -> RowStreamFactory | None:
    if variant.sparsifier in ("random", "della_magprune"):
        return sampled_stream(della=variant.sparsifier == "della_magprune", consensus=variant.consensus)
    selector = _SELECTORS.get(variant.sparsifier or "")
    if selector is None:
        return None
    return task_vector_stream(selector, consensus=variant.consensus)


def _spec(variant: _Variant) -> MethodSpec:
    streamed = _streamed(variant)
    # A sparsified member is defined by its stream alone; the whole tensor is that stream's one chunk.
    merge = merge_task_vectors if streamed is None else one_chunk(streamed)
    return MethodSpec(
        name=variant.name,
        fn=merge,
        params=_params(variant),
        base=BasePolicy.REQUIRED,
        min_inputs=1,
        # Only the unsparsified sum is a per-position function of its inputs; every sparsifier ranks, samples
        # or rescales over the whole tensor.
        elementwise=variant.sparsifier is None,
        randomized=variant.sparsifier in ("random", "della_magprune"),
        title=variant.title,
        summary=variant.summary,
        reference=variant.reference,
        check=check_della_epsilon if variant.sparsifier == "della_magprune" else None,
        streamed=streamed,
        footprint=variant.footprint,
        # What a generation's candidates share: every member's task vectors, and the rank windows' keys of them.
        from_inputs=((TASK_VECTOR, TASK_KEYS, TASK_KEY_COUNTS) if variant.sparsifier in _SELECTORS
                     else (TASK_VECTOR,)),
        # Some rows alone: the rank windows' masks at those rows, from the whole tensor's keys. The random draws
        # (DARE, DELLA) are drawn over the whole tensor in order: no row's mask without every earlier draw.
        rows=_rows(variant),
    )


def _rows(variant: _Variant) -> RowSelection | None:
    selector = _SELECTORS.get(variant.sparsifier or "")
    return task_vector_rows(selector, consensus=variant.consensus) if selector is not None else None


# Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64); DELLA ranks rows
# in blocks (sparsify._ROW_BLOCK_ELEMENTS).
_DELLA_ROWS = row_block_scratch(sparsify._ROW_BLOCK_ELEMENTS)
_VARIANTS = (
    _Variant("task_arithmetic", None, False, False, False, "https://arxiv.org/abs/2212.04089",
             measured((4, 4), (2, 2), (2, 2), (8, 8)),
             "Task Arithmetic",
             "the base plus a weighted sum of each model's difference from it (task vectors)."),
    _Variant("ties", "magnitude", True, True, False, "https://arxiv.org/abs/2306.01708",
             measured((3.75, 8.25), (6, 3), (6, 3), (8, 16)),
             "TIES",
             "task vectors trimmed to their largest entries, with a per-parameter sign election before they "
             "are summed onto the base."),
    _Variant("dare_ties", "random", True, False, True, "https://arxiv.org/abs/2311.03099",
             measured((4.5, 8), (6.75, 3), (10.5, 2.25), (8, 16.25)),
             "DARE TIES",
             "task vectors randomly dropped and rescaled (DARE), then combined with TIES sign election."),
    _Variant("dare_linear", "random", False, False, True, "https://arxiv.org/abs/2311.03099",
             measured((4.5, 4), (8.25, 2), (10.5, 2.25), (12.25, 8.25)),
             "DARE linear",
             "task vectors randomly dropped and rescaled (DARE), then summed onto the base."),
    _Variant("breadcrumbs", "magnitude_outliers", False, False, False, "https://arxiv.org/abs/2312.06795",
             measured((5, 4), (3.25, 3.5), (3.25, 3.5), (-7, 15.5)),
             "Model Breadcrumbs",
             "task vectors with both the smallest and the largest outlier entries removed, summed onto the "
             "base."),
    _Variant("breadcrumbs_ties", "magnitude_outliers", True, False, False, "https://arxiv.org/abs/2312.06795",
             measured((3.75, 8.25), (2.25, 4), (2.25, 4), (8, 16)),
             "Model Breadcrumbs with TIES",
             "Breadcrumbs masks combined with TIES sign election."),
    _Variant("della", "della_magprune", True, True, True, "https://arxiv.org/abs/2406.11617",
             measured((4, 4, 17.5, 5.25, None, (-7.5, 6.5)), (0.75, 2, 13.5, 8.5), (7.25, 2, 10.75, 8.5),
                      (-10.5, 12, 35, 0.25), scratch=_DELLA_ROWS),
             "DELLA",
             "task vectors dropped with probabilities that fall with magnitude, rescaled, then combined with "
             "TIES sign election."),
    _Variant("della_linear", "della_magprune", False, False, True, "https://arxiv.org/abs/2406.11617",
             measured((1.25, 4, 10.75, 8.25), (0.75, 2, 13.5, 8.25), (7.25, 2, 10.75, 8.5), (2.75, 8, 13.5, 12.25),
                      scratch=_DELLA_ROWS),
             "DELLA linear",
             "DELLA's magnitude-aware dropping, then a plain weighted sum onto the base."),
)

SPECS = tuple(_spec(variant) for variant in _VARIANTS)
