"""``core_space``: LoRA adapters of one base merged in the space their stacked factors span (Core Space merging).

Reference: Panariello et al., "Accurate and Efficient Low-Rank Model Merging in Core Space", NeurIPS 2025,
https://arxiv.org/abs/2509.17786; the authors' code is ``MatrixPerLayerMerger.get_core_matrices`` and
``_merge_tensors`` in apanariello4/core-space-merging (``task_merger.py``, ``merging_functions.py``).

The planner (:mod:`resumerge.merge.plan.lorafactors`) hands the method, per adapted module, the base weight followed by
each adapter's two factors ``A₁, B₁, A₂, B₂, …`` (never the dense ``BᵢAᵢ``), each factor's per-input parameters
carrying its adapter's PEFT scale (``lora_alpha / r``, or ``/ √r`` with rsLoRA) and orientation; a tensor no
adapter changes reaches it as the base alone and stays the base, as in the authors' code.

With R = Σ rᵢ: ``A`` stacked is R × n and ``B`` stacked m × R; ``Vᴴ_ref`` and ``U_ref`` come from their thin SVDs
(the only SVDs of model size, and of rank R only); each task's core matrix is Mᵢ = U_refᵀ·(sᵢBᵢ)·Aᵢ·Vᴴ_refᵀ
(R × R); the inner method merges the Mᵢ into M; ΔW = U_ref·M·Vᴴ_ref and W = W₀ + α·ΔW. Since U_ref·U_refᵀ·Bᵢ = Bᵢ
and Aᵢ·Vᴴ_refᵀ·Vᴴ_ref = Aᵢ, the inner ``task_arithmetic`` gives Σ sᵢBᵢAᵢ exactly — what applying every adapter at
once would add. The PEFT scale is folded into Bᵢ (the authors' adapters have alpha = r, so their code applies
none); for TA and TSV the factor it goes into is irrelevant, for TIES it decides what the top-k compares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, WholeCost
from resumerge.merge.methods.spectral import finish
from resumerge.merge.methods.tsv import task_singular_vectors

# The per-input parameters the planner gives each factor (resumerge.merge.plan.lorafactors writes them).
FACTOR = "lora_factor"
SCALE = "lora_scale"
TRANSPOSED = "lora_fan_in_fan_out"
# The global parameter the planner sets on the units of a merged adapter (``--out-adapter``): "A" or "B", the factor
# the unit writes (A′ = Vᴴ_ref, B′ = α·U_ref·M); absent when the unit writes the merged weight.
EMIT = "lora_emit"
INNER_METHODS = ("task_arithmetic", "ties", "tsv")


def core_basis(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_ref, Vᴴ_ref) of the float64 factors: the left singular vectors of the stacked B's (m × R) and the right
    ones of the stacked A's (R × n), thin."""
    u_ref = torch.linalg.svd(torch.cat(list(b), dim=1), full_matrices=False)[0]
    vh_ref = torch.linalg.svd(torch.cat(list(a), dim=0), full_matrices=False)[2]
    return u_ref, vh_ref


def core_matrices(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], u_ref: torch.Tensor,
                  vh_ref: torch.Tensor) -> list[torch.Tensor]:
    """Each task's core matrix U_refᵀ·Bᵢ·Aᵢ·Vᴴ_refᵀ, formed through the factors (never m × n)."""
    return [(u_ref.T @ bi) @ (ai @ vh_ref.T) for ai, bi in zip(a, b, strict=True)]


def ties_core(cores: Sequence[torch.Tensor], density: float) -> torch.Tensor:
    """The authors' TIES on the flattened core matrices (``ties_merging``, disjoint mean): per task keep the entries
    whose magnitude is at least its k-th largest (k = ⌊d·density⌋, ties kept, the largest at least); elect each
    entry's sign as that of the pruned sum (a zero sum taking the sign of the summed elected signs); average the
    kept entries of that sign."""
    shape = cores[0].shape
    flat = torch.stack([c.reshape(-1) for c in cores])
    d = flat.shape[1]
    if density < 1:
        keep = int(d * density)
        kth = flat.abs().kthvalue(d - keep, dim=1, keepdim=True).values
        flat = flat * (flat.abs() >= kth)
    sign = torch.sign(flat.sum(dim=0))
    sign[sign == 0] = torch.sign(sign.sum())
    chosen = torch.where(sign.unsqueeze(0) > 0, flat > 0, flat < 0)
    picked = flat * chosen
    counts = (picked != 0).sum(dim=0).to(picked.dtype).clamp(min=1)
    return (picked.sum(dim=0) / counts).reshape(shape)


def merge_cores(cores: Sequence[torch.Tensor], inner: str, density: float) -> torch.Tensor:
    """M of the core matrices by the inner method: their sum, TIES, or TSV (1/T of each one's singular triplets,
    decorrelated; see :func:`resumerge.merge.methods.tsv.task_singular_vectors`)."""
    if inner == "task_arithmetic":
        total = cores[0].clone()
        for c in cores[1:]:
            total += c
        return total
    if inner == "ties":
        return ties_core(cores, density)
    zero = torch.zeros_like(cores[0])
    ctx = MergeContext(tensors=[zero, *cores], base_index=0, model_params=[{} for _ in range(len(cores) + 1)],
                       params={"scaling": 1.0, "svd": True})
    return task_singular_vectors(ctx)


def core_factors(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scales: Sequence[float], inner: str,
                 density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged delta as two float64 factors (B′ = U_ref·M, m × R′; A′ = Vᴴ_ref, R′ × n; R′ ≤ R = Σ rᵢ) of the
    adapters' factors ``a`` (rᵢ × n) and ``b`` (m × rᵢ), each adapter's ``scales`` folded into its B:
    ΔW = B′·A′. These are a merged adapter's factors with scale 1."""
    a64 = [ai.to(torch.float64) for ai in a]
    b64 = [bi.to(torch.float64) * float(s) for bi, s in zip(b, scales, strict=True)]
    u_ref, vh_ref = core_basis(a64, b64)
    merged = merge_cores(core_matrices(a64, b64, u_ref, vh_ref), inner, density)
    return u_ref @ merged, vh_ref


def core_space(ctx: MergeContext) -> torch.Tensor:
    """Return W₀ + α·ΔW in float64, ΔW the core-space merge of the adapters' factors that follow the base in
    ``ctx.tensors`` (pairs A, B, the planner's order; ΔW transposed for ``fan_in_fan_out`` layers and
    embeddings, as PEFT applies them). The base alone gives the base. A unit of a merged adapter (its ``EMIT``
    parameter set, the factors alone as inputs) returns that factor of ΔW = B′·A′ instead."""
    a, b, scales, transposed = _factors(ctx.tensors, ctx.model_params)
    emit = ctx.params.get(EMIT)
    if emit is not None:  # one factor of a merged adapter (no base among the inputs), scale 1, α in B′
        left, right = core_factors(a, b, scales, str(ctx.params["inner"]), float(ctx.params["density"]))
        return right if emit == "A" else left * float(ctx.params["scaling"])
    base = ctx.base.to(torch.float64)
    if not a:
        return base.clone()
    left, right = core_factors(a, b, scales, str(ctx.params["inner"]), float(ctx.params["density"]))
    delta = left @ right
    if transposed:
        delta = delta.T.contiguous()
    return finish(delta, base, float(ctx.params["scaling"]))


def _factors(tensors: Sequence[torch.Tensor], model_params: Sequence[Mapping[str, Any]]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float], bool]:
    a: list[torch.Tensor] = []
    b: list[torch.Tensor] = []
    scales: list[float] = []
    transposed = False
    for t, p in zip(tensors, model_params, strict=True):
        if p.get(FACTOR) == "A":
            a.append(t)
            transposed = bool(p.get(TRANSPOSED, False))
        elif p.get(FACTOR) == "B":
            b.append(t)
            scales.append(float(p[SCALE]))
    return a, b, scales, transposed


def _check(params: Mapping[str, Any], model_params: Sequence[Mapping[str, Any]]) -> str | None:
    if params.get("inner") not in INNER_METHODS:
        return f"inner must be one of {', '.join(INNER_METHODS)}, not {params.get('inner')!r}"
    return None


# Working memory, measured by tests/methods/footprint_cases.py's replay (torch 2.x CPU): the base widened to float64
# and the m × n delta B′·A′ in float64 that W₀ + α·ΔW is formed in (16 bytes per element; 8 for a float64 base,
# which is used as it is); the factors and the R × R core matrices are small beside a weight (R = Σ rᵢ ≪ m, n).
_WIDE = (16, 0)
_FLOAT64 = (8, 0)

SPEC = MethodSpec(
    name="core_space",
    title="Core Space merging of LoRA adapters",
    summary=(
        "LoRA adapters of one base merged through their factors: each adapter's update projected into the small "
        "space their stacked A and B factors span, merged there (task arithmetic, TIES or TSV), then mapped back."
    ),
    reference="https://arxiv.org/abs/2509.17786",
    fn=core_space,
    params=(
        ParamSpec("scaling", Scope.GLOBAL, float, default=1.0),
        ParamSpec("inner", Scope.GLOBAL, str, default="task_arithmetic"),
        ParamSpec("density", Scope.GLOBAL, float, default=0.1, minimum=0.0, maximum=1.0),
    ),
    base=BasePolicy.REQUIRED,
    min_non_base=1,
    check=_check,
    factor_inputs=True,
    # LAPACK's SVD splits its work by torch's thread count (TSV inside; the reference bases).
    thread_dependent=True,
    whole_cost=WholeCost(params=("inner",), bound="SVD-bound (2 SVDs of the stacked factors, float64)"),
    footprint=measured(_WIDE, _WIDE, _WIDE, _FLOAT64),
)
