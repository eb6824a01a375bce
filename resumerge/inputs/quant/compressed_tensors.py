"""compressed-tensors (llm-compressor, vLLM; Kimi-K2-Thinking's INT4 experts): ``(q − zp) · scale`` per grid block.

Formats: ``pack-quantized`` (INT 2/4/8 bits packed in int32 words, :mod:`.int_pack`; ``weight_shape`` holds the
unpacked ``[rows, cols]``), ``naive-quantized``/``int-quantized`` (one int8 per value) and ``float-quantized``
(F8_E4M3 codes, decoded by :func:`resumerge.inputs.quant.fp8_block.decode` with this scheme's grid). The strategy
sets the scale grid (:func:`strategy_block`): ``tensor`` one scale, ``channel`` one per row, ``group`` one per
``group_size`` columns of a row, ``block`` one per ``[bh, bw]`` block, edge blocks partial.

Decoding is in float32, exact: the library computes ``(q − zp) · scale`` in the scale's dtype, and that product
rounded once to the scale's dtype is what it gets (``q − zp`` and the product are exact in float32 for every
width here). Encoding follows ``calculate_qparams`` and the ``quantize`` forward of compressed-tensors 0.20 on a
float32 weight: min and max per block widened to include 0; symmetric ``scale = amax / ((qmax − qmin) / 2)``
(INT4 amax/7.5, INT8 amax/127.5, FP8 amax/448), asymmetric ``scale = (max − min) / (qmax − qmin)`` and
``zp = round(clamp(qmin − min / scale, qmin, qmax))``; the scale rounded to its stored dtype, zeros replaced by that
dtype's eps; codes ``clamp(w / scale + zp, qmin, qmax)`` rounded half to even (INT) or cast to E4M3 (FP8).
Stored codes do not survive decode → encode with fresh scales for INT (the largest code is 7 or −8 while the
scale assumes 7.5): a codec copies an unchanged tensor's stored bytes, or encodes with the stored scale
(:func:`quantize` with ``scale=``), which gives the stored codes back.
"""

from __future__ import annotations

from resumerge.inputs.quant import fp8_block, int_pack
from resumerge.inputs.quant.grid import Block, divide, grid_extremes, pieces
from resumerge.machine.torch_import import torch

__all__ = [
    "STRATEGIES",
    "decode_naive",
    "decode_packed",
    "pack_zero_point",
    "qparams",
    "quantize",
    "strategy_block",
    "unpack_zero_point",
]

STRATEGIES = ("tensor", "channel", "group", "block")
# Rows decoded per slab at least (a slab's unpacked values and its output stay in cache together).
_SLAB_ELEMENTS = 1 << 16


def strategy_block(strategy: str, shape: tuple[int, int], *, group_size: int | None = None,
                   block_structure: tuple[int, int] | None = None) -> Block:
    """The scale grid's block for a ``[rows, cols]`` weight quantized with ``strategy``."""
    rows, cols = shape
    if strategy == "tensor":
        return max(rows, 1), max(cols, 1)
    if strategy == "channel":
        return 1, max(cols, 1)
    if strategy == "group" and group_size:
        return 1, group_size
    if strategy == "block" and block_structure:
        return block_structure
    raise ValueError(f"no scale grid for strategy {strategy!r} (group_size {group_size}, block {block_structure})")


def _grid(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A stored scale or zero point as a float32 2-D grid (a per-tensor ``(1,)`` or ``()`` becomes ``(1, 1)``)."""
    if tensor is None:
        return None
    grid = tensor.to(torch.float32)
    return grid.reshape(1, 1) if grid.ndim < 2 else grid


def _scale(values: torch.Tensor, scale: torch.Tensor, block: Block, zero_point: torch.Tensor | None,
           row_start: int) -> None:
    grids = [g for g in (_grid(scale), _grid(zero_point)) if g is not None]
    for piece, parts in pieces(values, grids, block, row_start=row_start):
        if len(parts) == 2:
            piece.sub_(parts[1])
        piece.mul_(parts[0])


def decode_packed(words: torch.Tensor, scale: torch.Tensor, block: Block, *, bits: int, cols: int,
                  zero_point: torch.Tensor | None = None, row_start: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize rows ``[row_start, row_start + n)`` of a pack-quantized weight to float32 ``[n, cols]``.

    ``words``: those rows of ``weight_packed`` (``[n, packed_cols]`` int32); ``scale``: the grid from grid row
    ``row_start // block[0]`` on; ``zero_point``: the same rows of the *unpacked* zero points
    (:func:`unpack_zero_point`), or None when symmetric; ``out``: optional float32 ``[n, cols]`` buffer.
    """
    n = words.shape[0]
    per = 32 // bits
    width = words.shape[1] * per
    if out is None:
        out = torch.empty((n, cols), dtype=torch.float32, device=words.device)
    step = max(1, _SLAB_ELEMENTS // max(width, 1))
    scratch = None if width == cols else torch.empty((min(step, n), width), dtype=torch.float32,
                                                           device=words.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        target = out[a:b]
        if scratch is None:
            int_pack.decode_words(words[a:b], bits, target)
        else:
            wide = int_pack.decode_words(words[a:b], bits, scratch[: b - a])
            target.copy_(wide[:, :cols])
    _scale(out, scale, block, zero_point, row_start)
    return out


def decode_naive(codes: torch.Tensor, scale: torch.Tensor, block: Block, *, zero_point: torch.Tensor | None = None,
                 row_start: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize rows of a naive-/int-/float-quantized ``weight`` (int8 or float8_e4m3fn ``[n, cols]``) to
    float32, with the scale grid (and zero points) from grid row ``row_start // block[0]`` on."""
    if codes.dtype == torch.float8_e4m3fn and zero_point is None:
        grid = _grid(scale)
        assert grid is not None
        return fp8_block.decode(codes, grid, block, row_start=row_start, out=out)
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    out.copy_(codes)
    _scale(out, scale, block, zero_point, row_start)
    return out


def _range(bits: int, kind: str) -> tuple[float, float]:
    if kind == "float":
        if bits != 8:
            raise ValueError(f"float-quantized weights here are FP8, not {bits}-bit")
        return -fp8_block.E4M3_MAX, fp8_block.E4M3_MAX
    return float(-(1 << (bits - 1))), float((1 << (bits - 1)) - 1)


def _eps(dtype: torch.dtype) -> float:
    if dtype == torch.float8_e4m3fn:
        return 0.125
    return float(torch.finfo(dtype).eps)


def qparams(values: torch.Tensor, block: Block, *, bits: int, kind: str = "int", symmetric: bool = True,
            scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """compressed-tensors' ``calculate_qparams`` for float32 ``values`` (``[n, cols]`` from a block row on):
    ``(scale, zero_point)``, the scale grid in ``scale_dtype`` and the int8 zero points (None when symmetric)."""
    scale_dtype = torch.float32 if scale_dtype is None else scale_dtype  # not at import: torch is lazy
    qmin, qmax = _range(bits, kind)
    low, high = grid_extremes(values, block)
    low.clamp_(max=0.0)
    high.clamp_(min=0.0)
    zero_point = None
    if kind == "float" and not symmetric:
        raise ValueError("asymmetric float quantization is not a compressed-tensors format here")
    if symmetric:
        scale = divide(torch.maximum(low.abs(), high), (qmax - qmin) / 2)
    else:
        scale = divide(high - low, qmax - qmin)
        zero_point = torch.round((qmin - low / scale).clamp_(qmin, qmax).clamp_(-128, 127)).to(torch.int8)
    if scale_dtype != torch.float32:
        finfo = torch.finfo(scale_dtype)
        scale = scale.clamp(finfo.min, finfo.max).to(scale_dtype)
    scale = scale.masked_fill(scale == 0, _eps(scale_dtype))
    return scale, zero_point


def quantize(values: torch.Tensor, block: Block, *, bits: int, kind: str = "int", symmetric: bool = True,
             scale_dtype: torch.dtype | None = None, scale: torch.Tensor | None = None,
             zero_point: torch.Tensor | None = None,
             packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize float32 rows ``[n, cols]`` (from a block row on) as compressed-tensors compresses them: returns
    ``(codes, scale, zero_point)`` — int8 codes (``kind="int"``), or with ``packed`` the int32 ``weight_packed``
    words (:func:`int_pack.pack`), or float8_e4m3fn codes (``"float"``); the
    scale grid in ``scale_dtype``; the int8 zero points or None (pack them with :func:`pack_zero_point`).

    With ``scale`` (and ``zero_point``) given, those stored parameters are used instead of fresh ones: an unchanged
    tensor then gets its stored codes back. ``values`` is the kernel's scratch: it is left holding the scaled,
    clamped values. Pass a copy to keep it.
    """
    scale_dtype = torch.float32 if scale_dtype is None else scale_dtype  # not at import: torch is lazy
    qmin, qmax = _range(bits, kind)
    if scale is None:
        scale, zero_point = qparams(values, block, bits=bits, kind=kind, symmetric=symmetric,
                                    scale_dtype=scale_dtype)
    grids = [g for g in (_grid(scale), _grid(zero_point)) if g is not None]
    for piece, parts in pieces(values, grids, block):
        piece.div_(parts[0])
        if len(parts) == 2:
            piece.add_(parts[1])
    values.clamp_(qmin, qmax)
    if kind == "float":
        return values.to(torch.float8_e4m3fn), scale, zero_point
    codes = values.round_().to(torch.int8)
    return (int_pack.pack(codes, bits) if packed else codes), scale, zero_point


def unpack_zero_point(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """The ``[rows, groups]`` int8 zero points of an asymmetric pack-quantized weight (packed along rows)."""
    return int_pack.unpack(packed.t(), bits, rows).t().contiguous()


def pack_zero_point(zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[rows, groups]`` zero points along the rows, as compressed-tensors stores them."""
    return int_pack.pack(zero_point.t(), bits).t().contiguous()
