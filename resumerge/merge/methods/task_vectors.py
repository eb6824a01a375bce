"""The per-position core of the task-arithmetic family: task vectors in, weighted (and elected) sum out.

Everything here after a task vector's sparsification is a function of one position across the inputs, so plain
``task_arithmetic`` (:mod:`resumerge.merge.methods.task_arithmetic`) and every sparsified member's stream, over one
chunk or several (:mod:`resumerge.merge.methods.task_stream`, :mod:`resumerge.merge.methods.sample_stream`), share this
code and with it every rounding step: a chunk's result is the corresponding rows of the whole tensor's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.consensus import sign_consensus_weights
from resumerge.merge.methods.spec import InputsOnly, MergeContext
from resumerge.merge.methods.summation import row_sum

if TYPE_CHECKING:
    from torch import Tensor

# (input index, its task vector) -> the sparsified task vector. The task vector handed over is the caller's own
# buffer: the function may overwrite it and return it.
SparsifyOne = Callable[[int, "Tensor"], "Tensor"]


def _task_vector(ctx: MergeContext, index: int) -> Tensor:
    return torch.sub(ctx.tensors[index], ctx.base)


# δᵢ = θᵢ − B, of the inputs alone: a generation's candidates share it (each candidate copies it into its own slot).
TASK_VECTOR = InputsOnly("task vector", _task_vector, lambda itemsize: itemsize)


def combine_task_vectors(
    ctx: MergeContext, sparsify_one: SparsifyOne | None, *, consensus: bool, lent: bool = False
) -> Tensor:
    """Return B + λ·Σ wᵢ·mᵢ·sparsify_one(i, δᵢ) / D in the base's dtype, δᵢ = θᵢ − B (see
    :func:`resumerge.merge.methods.task_arithmetic.merge_task_vectors` for ``mᵢ`` and ``D``, and for ``normalize`` and
    ``lambda``, read from ``ctx.params``). Without non-base inputs the result is a copy of the base;
    raises ``ValueError`` without a base. ``lent``: the result and the task vectors are computed in the buffer the
    engine lends, where it lends one (:meth:`~resumerge.merge.methods.spec.MergeContext.result_buffer`: the result in
    its first entries), for a caller that asks for it nowhere else."""
    base = ctx.base
    others = ctx.others()
    if not others:
        return base.clone()
    lent_out: Tensor | None = None
    if lent and ctx.lend is not None and base.device.type == "cpu":  # else fresh, the result once it is needed
        # Fresh memory for the task vectors (several times the result's size) has its pages zeroed by the kernel
        # at first touch; the lent buffer's are warm from the tensors before.
        whole = ctx.result_buffer((len(others) + 1, base.numel()), base.dtype, base.device)
        lent_out, deltas = whole[0], whole[1:].view(len(others), *base.shape)
    else:
        deltas = base.new_empty((len(others), *base.shape))
    for slot, index in enumerate(others):
        # Each task vector is computed, sparsified and weighted in its own slot: no full-size temporaries.
        if ctx.memo is None:
            delta = torch.sub(ctx.tensors[index], base, out=deltas[slot])
        else:  # the same subtraction's bits, computed once for every merge of these inputs
            delta = deltas[slot].copy_(ctx.from_inputs(TASK_VECTOR, index))
        if sparsify_one is not None:
            sparse = sparsify_one(index, delta)
            if sparse.data_ptr() != delta.data_ptr():  # not already written in place (possibly as a view)
                delta.copy_(sparse.reshape(delta.shape))
            del sparse
        del delta  # a view: it would keep every task vector alive until the end
    # Weights are rounded to the inputs' dtype before use, exactly as mergekit builds its weight tensor.
    weights = torch.tensor(
        [float(ctx.model_params[i]["weight"]) for i in others], dtype=deltas.dtype, device=deltas.device
    ).reshape(len(others), 1)
    normalized = bool(ctx.params["normalize"])
    scale = float(ctx.params["lambda"])
    flat_base = base.reshape(-1)
    flat_deltas = deltas.reshape(len(others), -1)
    out = torch.empty(flat_base.shape, dtype=base.dtype, device=base.device) if lent_out is None else lent_out
    # What is left is a function of each position alone, so it runs one block of positions at a time: its
    # dozen passes then stay in the core's cache instead of streaming whole tensors through memory each
    # (della's combine took 13 ns per entry whole, ~4 in blocks), and every entry gets the same operations
    # whatever the block size, the same bits.
    step = _BLOCK_ENTRIES if flat_base.device.type == "cpu" else max(1, flat_base.numel())
    for start in range(0, flat_base.numel(), step):
        stop = start + step
        _combine_block(
            flat_deltas[:, start:stop], weights, flat_base[start:stop], out[start:stop],
            consensus=consensus, normalize=normalized, scale=scale,
        )
    return out.reshape(base.shape)


# Fills the sparsified task vector of input `index` at flat positions [start, stop) into `into` (a row of stop -
# start entries of the base's dtype, the caller's scratch).
FillBlock = Callable[[int, int, int, "Tensor"], None]
# A kernel with _combine_block's bits where its caller has shown them: (the block's sparsified task vectors, models ×
# positions, overwritten; the weights, models × 1; the base's positions; the output's positions) -> None.
CombineBlock = Callable[["Tensor", "Tensor", "Tensor", "Tensor"], None]


def combine_filled_blocks(ctx: MergeContext, fill: FillBlock, *, consensus: bool,
                          combine: CombineBlock | None = None) -> Tensor:
    """:func:`combine_task_vectors`' result, each non-base input's sparsified task vector written by ``fill`` one
    block of positions at a time into a scratch of one block per input (never a whole task vector per merge): the
    per-position core runs on the same values, block by block, so the result has the same bits wherever ``fill``
    writes what ``sparsify_one`` would leave at those positions. (A generation's candidates: the rank windows'
    masks built inside the block from the task vectors and keys they share,
    :mod:`resumerge.merge.methods.task_blocks`.)"""
    base = ctx.base
    others = ctx.others()
    if not others:
        return base.clone()
    flat_base = base.reshape(-1)
    total = flat_base.numel()
    step = _FILLED_BLOCK_ENTRIES if flat_base.device.type == "cpu" else max(1, total)
    scratch = base.new_empty((len(others), min(step, total)))
    weights = torch.tensor(
        [float(ctx.model_params[i]["weight"]) for i in others], dtype=base.dtype, device=base.device
    ).reshape(len(others), 1)
    normalized, scale = bool(ctx.params["normalize"]), float(ctx.params["lambda"])
    out = torch.empty(flat_base.shape, dtype=base.dtype, device=base.device)
    for start in range(0, total, step):
        stop = min(total, start + step)
        block = scratch[:, : stop - start]
        for slot, index in enumerate(others):
            fill(index, start, stop, block[slot])
        if combine is not None:
            combine(block, weights, flat_base[start:stop], out[start:stop])
        else:
            _combine_block(block, weights, flat_base[start:stop], out[start:stop],
                           consensus=consensus, normalize=normalized, scale=scale)
    return out.reshape(base.shape)


# Positions per block in combine_task_vectors: a few task vectors, their mask and two sums of this many entries
# fit in a core's L2 cache.
_BLOCK_ENTRIES = 1 << 16
# combine_filled_blocks': its blocks hold no mask or task vector of the whole tensor beside them, and twice as many
# positions run 5-10 % faster there (8 TIES candidates of a 2816 × 1024 bfloat16 tensor, one thread).
_FILLED_BLOCK_ENTRIES = 1 << 17


def _combine_block(
    deltas: Tensor, weights: Tensor, base: Tensor, out: Tensor, *, consensus: bool, normalize: bool, scale: float
) -> None:
    # deltas (models × positions) are the caller's sparsified task vectors, overwritten here; `out` receives
    # B + λ·Σ wᵢ·mᵢ·δᵢ / D for these positions.
    deltas.mul_(weights)
    if consensus:
        # A 1/0 mask of the deltas' dtype multiplies exactly like mergekit's bool mask (kept values unchanged,
        # dropped ones ±0 by their sign) and much faster; both products are taken in place.
        mask = sign_consensus_weights(deltas)
        # row_sum: torch's sum over the models, the same bits, without its slow outer reduction over two rows.
        mixed = row_sum(deltas.mul_(mask))
        divisor = row_sum(mask.mul_(weights))
        # A zero divisor becomes 1: adding 1 where it is ±0 and 0 elsewhere (exact, NaN stays NaN) is two fast
        # float passes into the dead mask's memory, where masked_fill_ over a bool mask is three times slower.
        divisor.add_(torch.eq(divisor, 0, out=mask[0]))
    else:
        mixed = row_sum(deltas)
        divisor = weights.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed /= divisor
    if scale != 1:
        mixed *= scale
    # mixed + base is base + mixed bit for bit (IEEE addition commutes); the task vectors, and so `mixed`, have
    # the base's dtype.
    torch.add(mixed, base, out=out)
