"""Block FP8 (DeepSeek-V3/R1, Kimi-K2, Qwen3 "-FP8"): F8_E4M3 codes times one float32 scale per block.

Decode (DeepSeek-V3 ``README_WEIGHTS.md``): ``w[i, j] = q[i, j] · s[i // bh, j // bw]`` in float32 —
``weight_scale_inv`` is multiplied despite its name — with partial edge blocks using their scale over fewer
elements. Encode (DeepSeek's ``act_quant_kernel``): per block ``s = amax(|w|) / 448`` in float32, codes
``clamp(w / s, −448, 448)`` rounded to the nearest E4M3 value (ties to even; the clamp is explicit, never left to
the cast); with ``scale_fmt="ue8m0"``, ``s = 2^ceil(log2(amax / 448))``, the exponent taken exactly (halved when
the block's largest code would round down to 224, see :func:`scales_for`).

An all-zero block gets scale 1, as transformers' ``Fp8Quantize`` stores it: its codes are zero under any scale, 1
is exact in every scale format (a power of two for ue8m0 too), and — unlike DeepSeek's kernel, which floors amax at
1e-4 — no block with a nonzero amax has its scale changed, so every block whose stored scale follows the rule
above survives a decode → encode round trip byte for byte (``fl(fl(448·s)/448) = s`` for every ``s = fl(a/448)``;
blocks whose amax is below 448 · 2^−126, where the scale is subnormal, are not guaranteed to).

The kernels take 2-D ``[rows, cols]`` tensors (:func:`decode` also a fused-experts ``[..., rows, cols]``, one
expert at a time) and work in slabs of whole block rows, so a codec can decode or encode any row chunk
``[a, b)``: decoding needs the scale rows :func:`~resumerge.inputs.quant.grid.grid_rows` names; encoding needs a
chunk that starts at a block row.
"""

from __future__ import annotations

from resumerge.inputs.quant.byte_tables import ByteTable, byte_table, decode_bytes, per_device
from resumerge.inputs.quant.grid import Block, divide, grid_max, pieces
from resumerge.machine.torch_import import torch

__all__ = ["E4M3_MAX", "decode", "encode", "scales_for"]

E4M3_MAX = 448.0
# Rows per slab at least: enough elements per kernel to amortise its launch (a block row is usually more).
_SLAB_ELEMENTS = 1 << 18


@per_device
def _table() -> ByteTable:
    """Each of the 256 E4M3 bytes' value."""
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return byte_table(every_byte.to(torch.float32).unsqueeze(1))


def _slabs(start: int, stop: int, bh: int, cols: int) -> list[tuple[int, int]]:
    """Row ranges (relative to ``start``) of whole block rows, each at least ``_SLAB_ELEMENTS`` when possible."""
    per = max(1, _SLAB_ELEMENTS // max(1, cols * bh)) * bh
    out = []
    row = start
    while row < stop:
        end = min(stop, (row // bh) * bh + per)
        out.append((row - start, end - start))
        row = end
    return out


def decode(codes: torch.Tensor, scale_inv: torch.Tensor, block: Block, *, row_start: int = 0,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize rows ``[row_start, row_start + n)`` of a block-FP8 weight to float32.

    ``codes``: those rows' ``[n, cols]`` float8_e4m3fn (or their uint8 bytes), or a fused ``[..., n, cols]``
    (experts) whose scales are ``[..., grid rows, grid cols]``; ``scale_inv``: the scale grid from grid row
    ``row_start // block[0]`` on (any float dtype; float8_e8m0fnu too); ``out``: an optional float32 buffer of
    ``codes``' shape, contiguous, to fill. Returns the float32 rows.
    """
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if codes.ndim > 2:
        lead = codes.reshape(-1, *codes.shape[-2:])
        grids = scale_inv.reshape(-1, *scale_inv.shape[-2:])
        targets = out.view(-1, *codes.shape[-2:])
        for index in range(lead.shape[0]):
            decode(lead[index], grids[index], block, row_start=row_start, out=targets[index])
        return out
    n, cols = codes.shape
    data = codes.contiguous().view(torch.uint8)
    scales = scale_inv.to(torch.float32)
    bh = block[0]
    first = row_start // bh
    for a, b in _slabs(row_start, row_start + n, bh, cols):
        slab = out[a:b]
        decode_bytes(data[a:b], _table(data.device), slab)
        grid = scales[(row_start + a) // bh - first:]
        for piece, (s,) in pieces(slab, [grid], block, row_start=row_start + a):
            piece.mul_(s)
    return out


def scales_for(amax: torch.Tensor, scale_fmt: str = "float") -> torch.Tensor:
    """The float32 scale of each block from its float32 ``amax``: ``amax / 448`` (``"float"``) or the power of
    two at or above it (``"ue8m0"``, halved when the largest code would round down to 224); 1 for an all-zero
    block; never 0 for a nonzero one (an amax so small that ``amax / 448`` underflows gets the smallest
    subnormal)."""
    scale = divide(amax, E4M3_MAX)
    scale.clamp_(min=torch.finfo(torch.float32).smallest_normal * 2.0 ** -23)
    if scale_fmt == "ue8m0":
        mantissa, exponent = torch.frexp(scale)
        # scale = m · 2^e with m in [0.5, 1): ceil(log2(scale)) is e, or e − 1 when m is exactly 0.5.
        exponent -= (mantissa == 0.5).to(exponent.dtype)
        scale = torch.ldexp(torch.ones_like(scale), exponent)
        # A largest value that lands in (224, 232] rounds to the code 224, and 224 · 2^k is 448 · 2^(k−1), which is
        # what encoding the decoded block would choose: choose it now, so a decoded block encodes back to itself.
        # The block's values are the same numbers either way (its tiny ones a little more precise).
        scale = torch.where((amax / scale <= 232.0) & (amax > 0), scale * 0.5, scale)
    elif scale_fmt != "float":
        raise ValueError(f"unknown scale_fmt {scale_fmt!r} (float or ue8m0)")
    return scale.masked_fill_(amax == 0, 1.0)


def encode(values: torch.Tensor, block: Block, *, scale_fmt: str = "float", scale_dtype: torch.dtype | None = None,
           codes_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 rows ``[n, cols]`` that start at a block row (the last block row may be partial only at
    the weight's end) to block FP8: returns ``(codes, scale_inv)``, ``[n, cols]`` float8_e4m3fn and the grid
    ``[ceil(n / bh), ceil(cols / bw)]`` in ``scale_dtype`` (the stored scale's dtype: the codes are computed with
    the scale rounded to it, so they decode with the scale as stored; float8_e8m0fnu holds ue8m0 scales exactly).

    ``values`` is only read (it must be contiguous): each slab's magnitudes, then its scaled and clamped values,
    are made in a slab-sized scratch that stays in cache, so a whole weight costs no full-size copy. ``codes_out``,
    if given, is filled and returned.
    """
    scale_dtype = torch.float32 if scale_dtype is None else scale_dtype  # not at import: torch is lazy
    n, cols = values.shape
    device = values.device
    codes = codes_out if codes_out is not None else torch.empty((n, cols), dtype=torch.float8_e4m3fn, device=device)
    bh = block[0]
    slabs = _slabs(0, n, bh, cols)
    scratch = torch.empty((max(b - a for a, b in slabs), cols), dtype=torch.float32, device=device) if slabs \
        else values
    grids = []
    for a, b in slabs:
        slab, work = values[a:b], scratch[: b - a]
        # A block's amax as the maximum of its |values| (exact: the same bits as max(|min|, max)), in one reduction.
        scale = scales_for(grid_max(torch.abs(slab, out=work), block), scale_fmt)
        if scale_dtype != torch.float32:
            scale = scale.to(scale_dtype).to(torch.float32)
        for (piece, (s,)), (target, _) in zip(pieces(slab, [scale], block), pieces(work, [scale], block),
                                              strict=True):
            torch.div(piece, s, out=target)
        work.clamp_(-E4M3_MAX, E4M3_MAX)
        codes[a:b].copy_(work)
        grids.append(scale)
    scale_inv = torch.cat(grids) if len(grids) != 1 else grids[0]
    return codes, scale_inv.to(scale_dtype)
