"""What the SVD merge methods share (``tsv``, ``iso_c``, ``iso_cts``): task vectors in float64, their mean for the
tensors that are not matrices, numerical rank, the partial-isometry polar factor, how the result is put back, and
the declaration they have in common (:func:`svd_method`).

Everything runs in float64 whatever the inputs' dtype and the result is returned in float64, so the engine rounds
once, to the output dtype. The authors' code (TSV-M, Iso-C/CTS) runs float32 on CUDA; float64 keeps a delta that
is small against its weight exact to the bit, and makes the singular vectors of close singular values stable.

**Rank.** Where a matrix has singular values that are zero up to rounding (a tensor no fine-tune changed, duplicate
tasks, a LoRA-merged fine-tune of exact rank r), LAPACK returns arbitrary orthonormal vectors for them: the authors'
code then orthogonalises those vectors together with the meaningful ones, and its result depends on the LAPACK
build. Here such components are dropped (σ ≤ σ_max·max(m, n)·ε, numpy's ``matrix_rank`` rule) and the polar factor
is the partial isometry on the range (:func:`polar`), which is unique. Where every matrix has full rank (any real
fine-tune's delta) this is exactly the authors' computation; where one has not, theirs is not defined and this is
its continuous extension (two identical tasks give that task's kept components, as one would).

**Signs.** A singular triplet's sign is free (LAPACK picks one); every output here is a product in which each
sign meets itself (u·σ·vᵀ, or a polar factor of a matrix of such columns), so it does not depend on the choice.

May import: torch, and the method declaration's own modules (spec, footprint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import Column, measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, WholeCost


def scaling(ctx: MergeContext) -> float:
    """The global ``scaling`` (α): the result is B + α·Δ_M."""
    return float(ctx.params["scaling"])


def as_matrix(ctx: MergeContext) -> bool:
    """Whether the output tensor is merged through its SVD: a 2-D tensor (a linear layer's weight), as the authors'
    code merges every 2-D parameter, unless its ``svd`` parameter is false (the planner's default for the token
    embedding and the head, see :data:`VOCAB_DEFAULTS`); others (norms, biases) take the mean path."""
    return ctx.base.dim() == 2 and bool(ctx.params["svd"])


# The ``svd`` parameter every SVD method declares, and its value on the vocabulary tensors (MethodSpec.vocab_defaults):
# mergekit's port (PR #639) averages embed_tokens and lm_head, whose SVD would hold tens of GB for a 128k vocabulary;
# the papers' CLIP models have no such tensors. ``svd: true`` (globally or by a filter) decomposes them too.
SVD_PARAM = ParamSpec("svd", Scope.GLOBAL, bool, default=True)
VOCAB_DEFAULTS = (("svd", False),)


def base_f64(ctx: MergeContext) -> torch.Tensor:
    """The base in float64 (the caller's tensor itself when it is float64 already: never to be written)."""
    return ctx.base.to(torch.float64)


def deltas(ctx: MergeContext, base: torch.Tensor) -> Iterator[torch.Tensor]:
    """Each task vector Δᵢ = θᵢ − B in float64, in config order, one at a time (a fresh tensor each)."""
    for i in ctx.others():
        yield ctx.tensors[i].to(torch.float64) - base


def delta_sum(ctx: MergeContext, base: torch.Tensor) -> torch.Tensor:
    """ΣΔᵢ in float64, summed in config order (zeros without other inputs)."""
    total = torch.zeros_like(base)
    for delta in deltas(ctx, base):
        total += delta
        del delta
    return total


def mean_path(ctx: MergeContext, base: torch.Tensor) -> torch.Tensor:
    """B + α·mean(Δᵢ): what every method here does with a tensor it does not decompose (the papers' mean path)."""
    tasks = len(ctx.others())
    total = delta_sum(ctx, base)
    if tasks:
        total /= tasks
    return finish(total, base, scaling(ctx))


def finish(merged: torch.Tensor, base: torch.Tensor, alpha: float) -> torch.Tensor:
    """B + α·Δ_M in float64, in ``merged``'s own buffer."""
    if alpha != 1:
        merged *= alpha
    return merged.add_(base)


def rank(s: torch.Tensor, shape: Sequence[int], scale: float | None = None) -> int:
    """How many of the descending singular values ``s`` of a matrix of ``shape`` are not zero up to rounding: above
    ``scale``·max(shape)·ε, ``scale`` being the largest of them unless given (a residual's is its matrix's norm
    before projection)."""
    if s.numel() == 0:
        return 0
    top = float(s[0]) if scale is None else scale
    return int((s > top * max(shape) * torch.finfo(torch.float64).eps).sum())


def polar(x: torch.Tensor) -> torch.Tensor:
    """The polar factor U·Vᴴ of ``x``'s thin SVD over its non-zero singular values: the nearest matrix with
    orthonormal columns (or rows) where ``x`` has full rank, and the partial isometry on its range where not (a
    zero matrix where ``x`` is zero)."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    kept = rank(s, x.shape)
    del s
    found: torch.Tensor = u[:, :kept] @ vh[:kept]
    return found


class Components:
    """Singular triplets collected from several matrices into preallocated panels: columns of U (m × capacity), σ's
    and rows of Vᴴ (capacity × n), in the order added — the authors' Ucat, scat and Vcat."""

    def __init__(self, like: torch.Tensor, capacity: int) -> None:
        m, n = like.shape
        self.u = like.new_empty((m, capacity))
        self.vh = like.new_empty((capacity, n))
        self.s = like.new_empty((capacity,))
        self.count = 0

    def add(self, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> None:
        """Append the triplets (u's columns, s, vh's rows)."""
        first, stop = self.count, self.count + s.shape[0]
        self.u[:, first:stop] = u
        self.s[first:stop] = s
        self.vh[first:stop] = vh
        self.count = stop

    def orthogonalised(self, sigmas: torch.Tensor | float) -> torch.Tensor:
        """polar(U)·diag(σ)·polar(Vᴴ) of the triplets added: ``sigmas`` per triplet, or one value for all."""
        if self.count == 0:
            return self.u.new_zeros((self.u.shape[0], self.vh.shape[1]))
        left = polar(self.u[:, : self.count])
        right = polar(self.vh[: self.count])
        del self.u, self.vh
        if isinstance(sigmas, torch.Tensor):
            left *= sigmas[: self.count]
        else:
            left *= sigmas
        return left @ right


def frobenius(x: torch.Tensor) -> float:
    """‖x‖_F (0 for an empty tensor)."""
    return float(torch.linalg.vector_norm(x)) if x.numel() else 0.0


def shorter_side(shape: Sequence[int]) -> int:
    """k = min(m, n) of a matrix, the number of its singular values."""
    return min(shape) if shape else 0


def svd_scratch(dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
    """The SVD methods' footprint scratch rule: (k·(m + n), k²) elements for an m × n matrix — the panels of singular
    vectors (U is m × k, Vᴴ k × n) and the square factors and LAPACK's workspace — and none for the mean path."""
    if len(shape) != 2:
        return 0, 0
    k = shorter_side(shape)
    return k * (shape[0] + shape[1]), k * k


def svd_method(name: str, title: str, summary: str, reference: str, fn: Callable[[MergeContext], torch.Tensor], *,
               params: Sequence[ParamSpec] = (), bound: str, wide: Column, float64: Column) -> MethodSpec:
    """The declaration of an SVD method on task vectors: ``scaling``, then ``params``, then ``svd`` (false for the
    vocabulary's rows, the planner's default); a base and two models at least; thread-dependent (LAPACK's SVD
    splits its work by torch's thread count); timed a call per shape and per value of ``params`` (its time is that
    of its SVDs, ``bound``, not of the tensor's elements); its working memory ``wide`` in float32, bfloat16 and
    float16 alike, ``float64`` in float64, each with the SVD's scratch (:func:`svd_scratch`), as
    tests/methods/footprint_cases.py's profiler replay (torch 2.x CPU) measures it on 24×24 to 2048×2048 weights: the
    mean path's float64 copies (fixed; a tensor of the other dtypes is widened), and for a matrix a phase of float64
    buffers of its size plus the singular-vector panels and LAPACK's workspace, per element of k·(m + n)."""
    return MethodSpec(
        name=name, title=title, summary=summary, reference=reference, fn=fn,
        params=(ParamSpec("scaling", Scope.GLOBAL, float, default=1.0), *params, SVD_PARAM),
        vocab_defaults=VOCAB_DEFAULTS, base=BasePolicy.REQUIRED, min_inputs=2, thread_dependent=True,
        whole_cost=WholeCost(params=(*(each.name for each in params), "svd"), bound=bound),
        footprint=measured(wide, wide, wide, float64, scratch=svd_scratch, flat_unless="svd"),
    )
