"""``ram`` and ``ramplus_tl``: Reinforced Agent Merging (keep unique updates whole, average shared ones).

Reference: https://arxiv.org/abs/2601.13572

Both give the bits of the plain whole-tensor expression (mergekit's, kept as the reference in
``tests/methods/test_ram.py``) but run over blocks of positions in buffers reused from block to block: their
working memory is a few cache-sized buffers rather than full-size temporaries per model, and every step is a
float×float operation (torch's mixed float×bool ones are many times slower). Why the bits are the same:

* Every step but the sum over models is elementwise, so computing a block at a time changes no number.
* The reference's term for a model, with δ zeroed where |δ| ≤ ε and k models touching the position, is
  δ·[k = 1] + δ·[k > 1]/k: that is δ/max(k, 1), except NaN where δ is ±inf (one product is inf·0). Here it is
  (δ − δ·[|δ| ≤ ε]) / max(k, 1): the same quotient, +0 where the model leaves the position untouched, NaN where
  δ is ±inf or NaN. k is counted as models − #[|δ| ≤ ε], which counts a NaN δ as touching: that position is
  NaN either way.
* torch's CPU sum over dim 0 starts from +0, so no term's zero sign shows; for up to four models every one of
  its code paths adds the terms left to right (in float32 for half types, rounded once), which :func:`_fold`
  does with a few additions instead of the reduction kernel. For more models torch.sum adds some columns (near
  the end of its vectorised loop) in another order than the rest, so each block calls torch.sum itself; blocks
  start at multiples of 64 positions and a shorter remainder joins the block before, which keeps every column
  in the same branch of that loop as in the whole tensor.

NaN results are NaN at the same positions; which NaN bits (sign, payload) they carry is not pinned, as torch's
own kernels differ there between their vectorised and scalar paths.
"""

from __future__ import annotations

import functools
import itertools
import math

from resumerge.machine.torch_import import dtype_name, torch
from resumerge.merge.methods.footprint import measured, model_block_scratch
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope

# torch runs an operation on the calling thread below this many elements: blocks stay under it, so a merge does
# not fight the engine's worker threads for cores, and its buffers stay in a core's cache.
_GRAIN = 32_768
# torch.sum's vectorised reduction over dim 0 takes columns in groups of up to 4 vectors of 16 float32 lanes;
# a block starting on a group boundary has its columns summed as in the whole tensor.
_GROUP = 64
# On an accelerator each operation is a kernel launch: far larger blocks.
_DEVICE_BLOCK = 1 << 22
# Up to this many rows, every code path of torch's CPU sum over dim 0 adds them left to right from +0.
_FOLD_ROWS = 4
_HALF = ("float16", "bfloat16")  # dtype names: torch is imported on first use

Rows = tuple["torch.Tensor", ...]


def _is_half(dtype: torch.dtype) -> bool:
    return dtype_name(dtype) in _HALF


def _block_width(models: int, device: torch.device) -> int:
    if device.type != "cpu":
        return _DEVICE_BLOCK
    # Room for a remainder of up to _GROUP - 1 positions joining the last block, still under the grain.
    return max(_GROUP, ((_GRAIN - 1) // models - _GROUP) // _GROUP * _GROUP)


def _spans(positions: int, width: int) -> list[tuple[int, int]]:
    """Blocks of ``width`` positions; a remainder shorter than a column group joins the block before it."""
    cuts = [*range(0, positions, width), positions]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < _GROUP:
        del cuts[-2]
    return list(itertools.pairwise(cuts))


class _Blocks:
    """One call's flattened inputs, its blocks of positions, and the buffers every block reuses."""

    def __init__(self, ctx: MergeContext) -> None:
        base = ctx.base
        others = [ctx.tensors[i] for i in ctx.others()]
        self.dtype = functools.reduce(torch.promote_types, (t.dtype for t in others), base.dtype)
        self.device = base.device
        self.base = base.reshape(-1)
        self.others = [t.reshape(-1) for t in others]
        self.models = len(others)
        self.spans = _spans(self.base.numel(), _block_width(self.models, self.device))
        self._width = max((stop - start for start, stop in self.spans), default=0)
        self._storage: dict[str, torch.Tensor] = {}
        # Views are made once per buffer and width (all blocks but the last share one): unbinding rows and
        # slicing cost about a microsecond each, as much as an operation on a block.
        self._views: dict[tuple[str, int], tuple[torch.Tensor, Rows]] = {}
        self._model_count = torch.tensor(float(self.models), dtype=self.dtype, device=self.device)

    def matrix(self, name: str, n: int, dtype: torch.dtype | None = None, rows: int = 0) -> tuple[torch.Tensor, Rows]:
        """A contiguous [rows (default: one per model), n] view of buffer ``name`` (of the compute dtype unless
        told), and its rows."""
        key = (name, n)
        if key not in self._views:
            count = rows or self.models
            if name not in self._storage:
                self._storage[name] = torch.empty(
                    count * self._width, dtype=dtype or self.dtype, device=self.device
                )
            whole = self._storage[name][: count * n].view(count, n)
            self._views[key] = (whole, whole.unbind(0))
        return self._views[key]

    def vector(self, name: str, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An [n] view of buffer ``name``."""
        return self.matrix(name, n, dtype, rows=1)[1][0]

    def deltas(self, start: int, stop: int) -> tuple[torch.Tensor, Rows]:
        """The block's δᵢ = θᵢ − θ_base: a [models, n] matrix and its rows."""
        deltas, rows = self.matrix("deltas", stop - start)
        base = self.base[start:stop]
        for row, tensor in zip(rows, self.others, strict=True):
            torch.sub(tensor[start:stop], base, out=row)
        return deltas, rows

    def untouched(self, start: int, stop: int, epsilon: float) -> tuple[torch.Tensor, Rows, torch.Tensor, torch.Tensor]:
        """Return the block's δ (matrix and rows), its masks [|δ| ≤ ε] as 1.0/0.0, and how many models leave each
        position untouched."""
        n = stop - start
        deltas, rows = self.deltas(start, stop)
        masks, mask_rows = self.matrix("masks", n)
        # The complement of the reference's `deltas.abs() > epsilon` (compared the same way, in δ's dtype) but
        # at a NaN δ; a NaN ε, which the reference's test never passes, leaves everything untouched.
        torch.le(torch.abs(deltas, out=masks), math.inf if math.isnan(epsilon) else epsilon, out=masks)
        return deltas, rows, masks, _add_rows(mask_rows, self.vector("count", n))

    def share(self, deltas: torch.Tensor, masks: torch.Tensor, untouched: torch.Tensor) -> None:
        """Turn ``deltas`` in place into each model's term δ·[touched]/max(k, 1) (NaN where δ is not finite, see
        the module notes); ``untouched`` is overwritten with the divisor."""
        divisor = torch.sub(self._model_count, untouched, out=untouched).clamp_(min=1)
        deltas.addcmul_(deltas, masks, value=-1).div_(divisor)


def _add_rows(rows: Rows, out: torch.Tensor) -> torch.Tensor:
    # Sums of 1.0/0.0 masks: whole numbers up to the model count, exact in any order (in bfloat16 up to 256
    # models, where the reference's int64 counts would round the same way when it divides by them).
    if len(rows) == 1:
        return out.copy_(rows[0])
    torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        out.add_(row)
    return out


def _fold(terms: torch.Tensor, rows: Rows, out: torch.Tensor, wide: tuple[torch.Tensor, Rows] | None) -> torch.Tensor:
    """Return ``torch.sum(terms, dim=0)`` in ``out``, bit for bit; ``wide`` is a float32 buffer of ``terms``'s
    shape, needed for three or four rows of a half type."""
    if len(rows) > _FOLD_ROWS or terms.device.type != "cpu":
        return torch.sum(terms, dim=0, out=out)
    if len(rows) > 2 and _is_half(terms.dtype):
        # torch adds half types in float32 and rounds once at the end.
        if wide is None:
            raise ValueError("three or four half-precision rows need a float32 buffer")
        widened, wide_rows = wide
        acc = wide_rows[0]
        widened.copy_(terms)
        for row in wide_rows[1:]:
            acc.add_(row)
        return out.copy_(acc.add_(0.0))
    # Two rows of a half type: a half-type addition also rounds their float32 sum once.
    if len(rows) == 1:
        return torch.add(rows[0], 0.0, out=out)
    torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        out.add_(row)
    # torch's sum starts from +0, so terms that are all -0 sum to +0.
    return out.add_(0.0)


def ram(ctx: MergeContext) -> torch.Tensor:
    """Return B + Σᵢ δᵢ·[touched once] + Σᵢ δᵢ·[touched by k > 1]/k, per position, in the inputs' dtype.

    A model touches a position when |δᵢ| > ``epsilon``; untouched entries contribute nothing. Element-wise.
    Without non-base inputs the result is a copy of the base; raises ``ValueError`` without a base.
    """
    base = ctx.base
    if not ctx.others():
        return base.clone()
    epsilon = float(ctx.params["epsilon"])
    blocks = _Blocks(ctx)
    out = torch.empty(blocks.base.numel(), dtype=blocks.dtype, device=blocks.device)
    widen = _is_half(blocks.dtype) and 2 < blocks.models <= _FOLD_ROWS
    for start, stop in blocks.spans:
        n = stop - start
        deltas, rows, masks, untouched = blocks.untouched(start, stop, epsilon)
        blocks.share(deltas, masks, untouched)
        wide = blocks.matrix("wide", n, torch.float32) if widen else None
        merged = _fold(deltas, rows, blocks.vector("sums", n), wide)
        torch.add(blocks.base[start:stop], merged, out=out[start:stop])
    return out.view(base.shape)


def _count_touches(blocks: _Blocks, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return, per model, how many positions it touches and how many it touches alone (float64, exact)."""
    # Counted in float32 whatever the dtype (whole numbers below 2²⁴ per block, which a half type would round),
    # one row per block, added up in float64 at the end.
    touches = torch.empty(len(blocks.spans), blocks.models, dtype=torch.float32, device=blocks.device)
    alone = torch.empty_like(touches)
    for index, (start, stop) in enumerate(blocks.spans):
        n = stop - start
        magnitudes = torch.abs_(blocks.deltas(start, stop)[0])
        masks, mask_rows = blocks.matrix("touched", n, torch.float32)
        torch.gt(magnitudes, epsilon, out=masks)  # the reference's test: a NaN δ touches nothing
        touching = _add_rows(mask_rows, blocks.vector("touching", n, torch.float32))
        torch.sum(masks, dim=1, out=touches[index])
        torch.mv(masks, torch.eq(touching, 1, out=touching), out=alone[index])
    return touches.sum(dim=0, dtype=torch.float64), alone.sum(dim=0, dtype=torch.float64)


def ramplus_tl(ctx: MergeContext) -> torch.Tensor:
    """Return :func:`ram` with each model's unique updates amplified by λᵢ = 1 + r·clip(ρᵢ, 0, alpha).

    ρᵢ = (positions model i shares with others) / max(positions only model i touched, epsilon), counted over
    the whole tensor ("tensor-local"), so the result is not element-wise. λ is float32, so for half-precision
    inputs the result is float32 (as in mergekit; the engine casts it to the output dtype).
    """
    base = ctx.base
    if not ctx.others():
        return base.clone()
    epsilon = float(ctx.params["epsilon"])
    r = float(ctx.params["r"])
    alpha = float(ctx.params["alpha"])
    blocks = _Blocks(ctx)
    # A first pass counts the touches; λ is then the reference's expression on the same int64 counts.
    touches, alone = _count_touches(blocks, epsilon)
    shared_count = (touches - alone).to(torch.int64)
    unique_count = alone.to(torch.int64)
    rho = shared_count / unique_count.clamp(min=epsilon)
    amplify = 1 + r * rho.clamp(min=0, max=alpha)
    result = torch.promote_types(blocks.dtype, amplify.dtype)
    lam = amplify.to(result).unsqueeze(1)
    out = torch.empty(blocks.base.numel(), dtype=result, device=blocks.device)
    widen = result != blocks.dtype
    lone = float(blocks.models - 1)  # a position touched by one model is left untouched by the others
    for start, stop in blocks.spans:
        n = stop - start
        deltas, rows, masks, untouched = blocks.untouched(start, stop, epsilon)
        # Compared in the result dtype: converting the counts once is cheaper than two mixed-dtype comparisons.
        counted = blocks.vector("counted", n, result).copy_(untouched) if widen else untouched
        single = torch.eq(counted, lone, out=blocks.vector("single", n, result))
        several = torch.ne(counted, lone, out=blocks.vector("several", n, result))
        blocks.share(deltas, masks, untouched)
        # The reference's term (δ·[k = 1])·λ + δ·[k > 1]/k is the share δ/max(k, 1) (rounded in the compute
        # dtype, as δ/k is there) times λ where one model touches the position, and times ±0·λ + 1 elsewhere:
        # 1 for a finite λ, NaN for an infinite or NaN one, as ±0·λ is there. Both products are exact.
        scale, _ = blocks.matrix("scale", n, result)
        torch.addcmul(several, single, lam, out=scale)
        terms, term_rows = blocks.matrix("widened", n, result) if widen else (deltas, rows)
        if widen:
            terms.copy_(deltas)  # explicitly: a mixed-dtype product would allocate this copy on every block
        merged = _fold(terms.mul_(scale), term_rows, blocks.vector("sums", n, result), None)
        if widen:
            out[start:stop].copy_(blocks.base[start:stop]).add_(merged)
        else:
            torch.add(blocks.base[start:stop], merged, out=out[start:stop])
    return out.view(base.shape)


SPEC = MethodSpec(
    name="ram",
    title="RAM",
    summary=(
        "each parameter takes the mean change of only the models that changed it (reinforced agent "
        "merging)."
    ),
    reference="https://arxiv.org/abs/2601.13572",
    fn=ram,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((4, 0, 8, 8), (1.75, 0.25, 4, 4, None, (2, 0)), (1.75, 0.25, 4, 4, None, (2, 0)),
                       (8, 0, 16, 16), scratch=model_block_scratch(_GRAIN, widen_half=True)),
    params=(ParamSpec("epsilon", Scope.GLOBAL, float, default=1e-5, minimum=0.0),),
    base=BasePolicy.REQUIRED,
    min_inputs=1,
    elementwise=True,
)

SPEC_PLUS = MethodSpec(
    name="ramplus_tl",
    title="RAM+ (tensor level)",
    summary="RAM with contributions unique to one model scaled up by how much the models overlap.",
    reference="https://arxiv.org/abs/2601.13572",
    fn=ramplus_tl,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((4, 0, 16.25, 20), (4, 0, 16.25, 22.25), (4, 0, 16.25, 22.25), (8, 0, 28.25, 36.25),
                       scratch=model_block_scratch(_GRAIN, widen_half=False)),
    params=(
        ParamSpec("r", Scope.GLOBAL, float, default=0.1),
        ParamSpec("alpha", Scope.GLOBAL, float, default=0.2, minimum=0.0),
        # Strictly positive: epsilon also floors ρ's denominator, and a model with no touched positions
        # would otherwise get 0/0 = NaN for λ, which poisons every position (NaN·0 is NaN).
        ParamSpec("epsilon", Scope.GLOBAL, float, default=1e-5, minimum=0.0, exclusive_min=True),
    ),
    base=BasePolicy.REQUIRED,
    min_inputs=1,
    half_result_float32=True,
)
