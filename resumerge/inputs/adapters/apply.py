"""Merge a LoRA delta into a weight exactly as PEFT's ``merge_and_unload`` does, in any row chunking.

PEFT (``peft.tuners.lora.layer``) holds the factors in float32 (it up-casts bf16/fp16 adapter weights; a float64
base keeps float64), computes ``ΔW = transpose(B @ A, fan_in_fan_out) * scaling`` in that dtype, and then

* for a linear layer adds it in place: ``W += ΔW`` (float32 arithmetic, one rounding to W's dtype);
* for an embedding first rounds it: ``W += ΔW.to(W.dtype)``.

``B @ A`` is a BLAS ``sgemm`` whose result for a given element depends on the shape of the call (measured with
MKL: rows computed in smaller calls differ in the last bit), so calling ``matmul`` per chunk would make the
merged bytes depend on how a tensor was chunked. Instead every element is computed on its own, as the
sequential fused multiply-add chain a GEMM kernel performs when the rank fits its K block:
``acc = fma(B[i, k], A[k, j], acc)`` for ``k = 0 … r-1``. Each step is done in float64 — the product of two
float32 values is exact there — and rounded to float32, so the result is that of a true FMA except when the
float64 sum lands exactly on a float32 tie (about 2⁻²⁹ of steps), and it is the same whatever the chunking,
the thread count or the CPU. Measured against MKL on AVX2 it equals ``B @ A`` bit for bit for ranks up to 192
(MKL's K block there; larger ranks it sums in blocks) and matrices of at least 16 rows and 16 columns (smaller
ones take another code path), so bf16 merges match PEFT's bits; otherwise results agree to within a rounding.

On the CPU, work is done in tiles of about 16 384 elements, which keeps each torch operation on the calling
thread (torch parallelises larger ones) and in cache. Cost: 1–3 ns per ``rows × cols × rank`` on one core
(rank 16 on a 4096 × 4096 weight: about a second); extra memory: the output plus under 1 MiB.
"""

from __future__ import annotations

from resumerge.machine.torch_import import dtype_name, torch

# torch runs an elementwise operation on one thread below its grain size (32 768 elements); staying under it
# keeps merges from fighting the engine's worker threads for cores, and the tile in cache. On an accelerator,
# where each operation costs a kernel launch, tiles are much larger.
_CPU_TILE_ELEMENTS = 16_384
_DEVICE_TILE_ELEMENTS = 1 << 22
_FLOATS = ("float32", "float16", "bfloat16", "float64")  # dtype names: torch is imported on first use


def apply_lora(
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    fan_in_fan_out: bool,
    *,
    embedding: bool = False,
) -> torch.Tensor:
    """Return ``weight`` merged with the LoRA delta ``scale · (B @ A)`` (transposed under ``fan_in_fan_out``).

    ``weight`` is ``(out, in)`` with ``a`` ``(r, in)`` and ``b`` ``(out, r)``; under ``fan_in_fan_out`` it is
    ``(in, out)`` (GPT-2 ``Conv1D``), and for an embedding (``embedding=True``, which requires
    ``fan_in_fan_out=True``) it is ``(num_embeddings, dim)`` with ``a`` ``(r, num_embeddings)`` and ``b``
    ``(dim, r)``. The factors may have any float dtype (they are cast to float32 as PEFT does); the result has
    ``weight``'s dtype and device, and ``weight`` is not modified. Raises ``ValueError`` for shapes that do not
    fit or non-float tensors.
    """
    return apply_lora_rows(weight, a, b, scale, fan_in_fan_out, first_row=0, embedding=embedding)


def apply_lora_rows(
    weight_rows: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    fan_in_fan_out: bool,
    *,
    first_row: int,
    embedding: bool = False,
) -> torch.Tensor:
    """Merge rows ``[first_row, first_row + len(weight_rows))`` of a weight; ``a`` and ``b`` are the WHOLE factors.

    Row ``i`` of the weight takes its delta from row ``i`` of ``B`` (``scale · B[i] @ A``), or, under
    ``fan_in_fan_out`` and for embeddings, from column ``i`` of ``A`` (``scale · (B @ A[:, i])ᵀ``); the other
    factor is used whole, and both are small (``rank × dim``), so the caller reads them entirely. The rows
    returned are bit-identical to the same rows of :func:`apply_lora` on the whole weight, for any split.
    """
    _check(weight_rows, a, b, fan_in_fan_out, first_row, embedding)
    compute = torch.float64 if weight_rows.dtype == torch.float64 else torch.float32
    device = weight_rows.device
    stop = first_row + weight_rows.shape[0]
    if fan_in_fan_out:
        left = a[:, first_row:stop].to(device=device, dtype=compute).t()
        right = b.to(device=device, dtype=compute).t()
    else:
        left = b[first_row:stop].to(device=device, dtype=compute)
        right = a.to(device=device, dtype=compute)
    rows, cols = weight_rows.shape
    # columns[k] is column k of the left factor and lines[k] row k of the right one, as exact float64 copies.
    columns = left.to(torch.float64).t().contiguous()
    lines = right.to(torch.float64).contiguous()
    out = torch.empty((rows, cols), dtype=weight_rows.dtype, device=device)
    budget = _CPU_TILE_ELEMENTS if device.type == "cpu" else _DEVICE_TILE_ELEMENTS
    width = max(1, min(cols, budget))
    height = max(1, budget // width)
    chain = _Chain(height * width, compute, device)
    for r0 in range(0, rows, height):
        r1 = min(rows, r0 + height)
        for c0 in range(0, cols, width):
            c1 = min(cols, c0 + width)
            delta = chain.product(columns[:, r0:r1], lines[:, c0:c1])
            delta.mul_(scale)  # PEFT: ``transpose(B @ A) * scaling``, a float32 tensor times a Python float
            target = out[r0:r1, c0:c1]
            target.copy_(weight_rows[r0:r1, c0:c1])
            target.add_(delta.to(weight_rows.dtype) if embedding else delta)
    return out


class _Chain:
    """Buffers for one tile of ``left @ right``, computed element by element as a multiply-add chain over the rank."""

    def __init__(self, elements: int, compute: torch.dtype, device: torch.device) -> None:
        self.compute = compute
        self.acc = torch.empty(elements, dtype=torch.float64, device=device)
        # float32: where each step is rounded; float64: where each product is formed before it is added.
        self.step = torch.empty(elements, dtype=compute, device=device)

    def product(self, columns: torch.Tensor, lines: torch.Tensor) -> torch.Tensor:
        """``columns.T @ lines`` for ``columns`` ``(rank, n)`` and ``lines`` ``(rank, m)``; a view of a buffer."""
        rank, n = columns.shape
        m = lines.shape[1]
        acc = self.acc[: n * m].view(n, m)
        step = self.step[: n * m].view(n, m)
        acc.zero_()
        if self.compute == torch.float32:
            for k in range(rank):
                # A product of two float32 values is exact in float64, so a float64 multiply-add rounded once to
                # float32 is float32's fused multiply-add (barring a double-rounding tie).
                acc.addcmul_(columns[k].unsqueeze(1), lines[k].unsqueeze(0))
                step.copy_(acc)
                acc.copy_(step)
            return step
        # float64 weights: products are rounded, so multiply and add stay separate operations (a compiler may
        # fuse an addcmul on one code path and not another, and the bits would depend on where a tile ends).
        for k in range(rank):
            torch.mul(columns[k].unsqueeze(1), lines[k].unsqueeze(0), out=step)
            acc.add_(step)
        return acc


def _check(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fan_in_fan_out: bool, first_row: int, embedding: bool
) -> None:
    if weight.dim() != 2 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"LoRA needs 2-D tensors, got weight {list(weight.shape)}, A {list(a.shape)}, "
                         f"B {list(b.shape)}")
    if any(dtype_name(t.dtype) not in _FLOATS for t in (weight, a, b)):
        raise ValueError(f"LoRA needs float tensors, got {weight.dtype}, {a.dtype}, {b.dtype}")
    if embedding and not fan_in_fan_out:
        raise ValueError("an embedding LoRA delta is always transposed: pass fan_in_fan_out=True")
    rank = a.shape[0]
    if rank < 1 or b.shape[1] != rank:
        raise ValueError(f"A {list(a.shape)} and B {list(b.shape)} do not share a positive rank")
    total, cols = (a.shape[1], b.shape[0]) if fan_in_fan_out else (b.shape[0], a.shape[1])
    if weight.shape[1] != cols or first_row < 0 or first_row + weight.shape[0] > total:
        raise ValueError(
            f"weight rows {first_row}..{first_row + weight.shape[0]} of shape {list(weight.shape)} do not fit a "
            f"delta of shape {[total, cols]}"
        )
