"""``regmean``: Regression Mean, each linear layer merged as the least-squares fit of every model's outputs on its
own measured inputs.

Reference: Jin et al., "Dataless Knowledge Fusion by Merging Weights of Language Models", ICLR 2023,
https://arxiv.org/abs/2212.09849; the authors' code is ``regmean_mean_params`` in bloomberg/dataless-model-merging
(``src/model_merge/avg_merger.py``); see ``shared/reference/methods-2025.md`` §7.

For a linear weight Wᵢ (m × n, out × in) of each of T models, with Gᵢ the Gram matrix (n × n, the mean of x·xᵀ over
the token positions model i's layer saw, measured by ``resumerge measure``), the merge is

    W = (Σ Wᵢ·G̃ᵢ)·(Σ G̃ᵢ)⁻¹,   G̃ᵢ = a·Gᵢ + (1 − a)·diag(Gᵢ),

the W that minimises Σ ‖X̃ᵢ·Wᵀ − X̃ᵢ·Wᵢᵀ‖²: a = ``reduce_non_diagonal_ratio`` scales the off-diagonal entries (the
name the authors' code and FusionBench give it). Every other tensor (biases, norms, embeddings, the head, a matrix
without Grams) is the plain mean, as in the authors' code.

The planner hands the method its inputs as the T weights, then the T Grams, each Gram marked by the per-model
parameter :data:`GRAM` (see :mod:`resumerge.merge.plan.grams`), so the method stays a pure function of its tensors.

**Solve.** In float64: (Σ G̃ᵢ) is factored by Cholesky and Wᵀ found by its triangular solves. An input coordinate
no token reached (a zero diagonal entry of Σ G̃ᵢ, whose row and column are then zero) carries no data: its column
of W is the plain mean, and the rest is solved without it (the equations separate exactly). Where the Cholesky
factorisation fails or its diagonal says Σ G̃ᵢ is ill-conditioned ((max Lⱼⱼ / min Lⱼⱼ)² > :data:`MAX_CONDITION`, a
lower bound of the condition number), the pseudo-inverse is used instead (``pinv``, as MergeBench falls back).
With a < 1 and every coordinate reached, Σ G̃ᵢ is positive definite whatever the token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import Footprint, MethodFootprint
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, WholeCost

# The per-model parameter that marks an input as a Gram matrix (set by the planner, never by a config).
GRAM = "regmean_gram"
RATIO = "reduce_non_diagonal_ratio"
# The global parameter naming the measurement folder (``resumerge measure``'s OUT_DIR).
GRAMS = "grams"
# Above this (a lower bound of the condition number of Σ G̃ᵢ from its Cholesky factor), the pseudo-inverse: as
# MergeBench's threshold on torch.linalg.cond.
MAX_CONDITION = 1e8


def regularised(gram: torch.Tensor, ratio: float) -> torch.Tensor:
    """G̃ = a·G + (1 − a)·diag(G) in float64 (a new tensor)."""
    g = gram.to(torch.float64, copy=True)
    if ratio != 1.0:
        diagonal = torch.diagonal(g).clone()
        g.mul_(ratio)
        torch.diagonal(g).copy_(diagonal)
    return g


def regmean_solve(weights: Sequence[torch.Tensor], grams: Sequence[torch.Tensor], ratio: float
                  ) -> tuple[torch.Tensor, bool]:
    """(W, used_pinv): W = (Σ Wᵢ·G̃ᵢ)(Σ G̃ᵢ)⁻¹ in float64 for weights Wᵢ (m × n) and Grams Gᵢ (n × n), the
    off-diagonals of each Gram scaled by ``ratio``; ``used_pinv`` says the pseudo-inverse replaced the Cholesky
    solve (see the module docstring). Raises ``ValueError`` for mismatched shapes."""
    if len(weights) != len(grams) or not weights:
        raise ValueError(f"regmean needs one Gram per weight, got {len(weights)} weights and {len(grams)} Grams")
    m, n = weights[0].shape
    total = torch.zeros(n, n, dtype=torch.float64, device=weights[0].device)
    products = torch.zeros(m, n, dtype=torch.float64, device=weights[0].device)
    for w, g in zip(weights, grams):
        if tuple(g.shape) != (n, n) or tuple(w.shape) != (m, n):
            raise ValueError(f"a Gram of shape {tuple(g.shape)} does not fit a weight of shape {tuple(w.shape)}")
        tilde = regularised(g, ratio)
        total.add_(tilde)
        products.addmm_(w.to(torch.float64), tilde)
        del tilde
    live = torch.diagonal(total) > 0
    averaged = None
    if not bool(live.all()):
        averaged = mean(weights)
        index = live.nonzero().flatten()
        total, products = total[index][:, index], products[:, index]
    solved, used_pinv = _solve(total, products)
    if averaged is None:
        return solved, used_pinv
    averaged[:, live] = solved
    return averaged, used_pinv


def _solve(total: torch.Tensor, products: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """X with X·total = products (total symmetric positive semi-definite): Cholesky, else the pseudo-inverse."""
    if total.numel() == 0:
        return products.clone(), False
    factor, info = torch.linalg.cholesky_ex(total)
    if int(info) == 0:
        diagonal = torch.diagonal(factor)
        low = float(diagonal.min())
        if low > 0 and (float(diagonal.max()) / low) ** 2 <= MAX_CONDITION:
            return torch.cholesky_solve(products.T.contiguous(), factor).T.contiguous(), False
    del factor
    return products @ torch.linalg.pinv(total, hermitian=True), True


def mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The plain mean of ``tensors`` in float64, summed in order."""
    acc = tensors[0].to(torch.float64, copy=True)
    for t in tensors[1:]:
        acc.add_(t.to(torch.float64))
    return acc.div_(len(tensors))


def regmean(ctx: MergeContext) -> torch.Tensor:
    """Return the RegMean merge of the context's weights in float64: :func:`regmean_solve` over the inputs
    without :data:`GRAM` and the Grams marked with it (same order), or the plain mean of the weights where the
    tensor has no Grams. Raises ``ValueError`` when the Grams do not pair with the weights."""
    weights = [t for t, p in zip(ctx.tensors, ctx.model_params) if not p.get(GRAM)]
    grams = [t for t, p in zip(ctx.tensors, ctx.model_params) if p.get(GRAM)]
    if not grams:
        return mean(weights)
    solved, _ = regmean_solve(weights, grams, float(ctx.params[RATIO]))
    return solved


def _gram_scratch(dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
    """Elements of the n × n float64 buffers the solve holds, n being the weight's input width: 4 n² (see
    :data:`FOOTPRINT`)."""
    if len(shape) != 2:
        return 0, 0
    n = int(shape[1])
    return 4 * n * n, 0


# Measured with the profiler replay of tests/methods/footprint_cases.py (the shared footprint table cannot measure
# it: its calls have no Grams) and checked by tests/methods/test_regmean.py. The solve holds 3.5 n² + 2.8 m·n
# float64 elements at its peak through the Cholesky path (the sum, a regularised Gram, the factor; the product sum,
# its transpose and the solution), 4-4.8 n² through the pseudo-inverse, whatever the number of models (it takes
# them one at a time); the mean path of a tensor without Grams holds its float64 sum and one input's float64 copy.
# Declared: 16 bytes per element of the weight and 4 n² of float64 (_gram_scratch), which the footprint's margin
# (1.25x) takes above every path measured. The Grams themselves are inputs (n × n float32 each), counted by the
# engine as it reads them. (Declared as 16 + 8 per input, weights and Grams, and 8 n² until issue 71: `plan`'s peak
# for a regmean merge was 1.9-2.2x the run's.)
_FLOAT64 = Footprint(16.0, 0.0, block=8.0)
FOOTPRINT = MethodFootprint(MappingProxyType({d: _FLOAT64 for d in ("float32", "bfloat16", "float16", "float64")}),
                            scratch=_gram_scratch)


SPEC = MethodSpec(
    name="regmean",
    title="RegMean (Regression Mean)",
    summary=(
        "each linear layer solved for the weight that best reproduces every model's outputs on the inputs it was "
        "measured on (their Gram matrices, off-diagonals scaled by reduce_non_diagonal_ratio); other tensors "
        "averaged."
    ),
    reference="https://arxiv.org/abs/2212.09849",
    fn=regmean,
    params=(
        ParamSpec(GRAMS, Scope.GLOBAL, str, required=True),
        ParamSpec(RATIO, Scope.GLOBAL, float, default=0.5, minimum=0.0, maximum=1.0),
    ),
    base=BasePolicy.IGNORED,
    min_inputs=1,
    # LAPACK's factorisation splits its work by torch's thread count.
    thread_dependent=True,
    # Its time is that of the solve (n³/3 for the factor, 2·m·n² per model for the products), not of its elements.
    whole_cost=WholeCost(bound="solve-bound (one n × n Cholesky and T products per linear, float64)"),
    footprint=FOOTPRINT,
    gram_inputs=True,
)

# RegMean++: the same solve on Grams measured on the merged model's earlier layers (``resumerge measure`` of a config
# with this method runs that pass, merging each layer as the solve above before running it); the planner checks
# that the Grams were measured so, for these models and this ratio.
SPEC_PLUS = replace(
    SPEC,
    name="regmean_plus",
    title="RegMean++",
    summary=(
        "RegMean with each layer's Gram matrices measured on the inputs the merged model's earlier layers give "
        "(off-diagonals scaled by reduce_non_diagonal_ratio); other tensors averaged."
    ),
    reference="https://arxiv.org/abs/2508.03121",
)
