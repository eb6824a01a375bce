"""MXFP4 (gpt-oss experts): E2M1 codes two to a byte, one E8M0 power-of-two scale per 32 values.

Stored (``X_blocks`` U8 ``[..., out, G, 16]``, ``X_scales`` U8 ``[..., out, G]``): byte ``b`` of a block holds
values ``2b`` (low nibble) and ``2b + 1`` (high nibble) of its 32 along the input dimension; a nibble is an E2M1
code (LUT ``[+0, 0.5, 1, 1.5, 2, 3, 4, 6, −0, −0.5, …, −6]``), a scale byte ``s`` means ``2^(s − 127)`` (255 is
NaN). The decoded tensor is laid out exactly as transformers' ``_convert_moe_packed_tensors`` returns it:
``[..., G · 32, out]``, the input dimension before the output one (its ``GptOssExperts`` shapes ``gate_up_proj``
``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``; gate and up interleaved on 2I as stored, even = gate).

Encode (OCP MX v1.0, as microsoft/microxcaling ``_quantize_mx`` with its default rounding): per group of 32,
``e = floor(log2(amax)) − 2`` (2 is E2M1's largest exponent; taken exactly from the float's exponent, never through
a rounded ``log2``), clamped to ``[−127, 127]``, stored ``e + 127``; an all-zero group gets ``e = −127`` (byte 0).
Values ``v / 2^e`` round to the nearest E2M1 value, ties away from zero, saturating at ±6; the sign is kept (−0 is
code 8). A group whose largest code is 4 or 6 — every group this encoder writes — survives decode → encode byte
for byte; a tool that rounds amax to a power of two first (compressed-tensors' ``mxfp_utils``) may store a scale
one lower, so a codec copies unchanged tensors' bytes.

Decoding and encoding go one leading index (one expert) at a time, in slabs of output rows; a codec chunks by
leading index.
"""

from __future__ import annotations

import math

from resumerge.inputs.quant.byte_tables import ByteTable, byte_table, decode_bytes, per_device
from resumerge.machine.torch_import import torch

__all__ = ["E2M1_VALUES", "GROUP", "decode", "decoded_shape", "encode"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
# Midpoints between consecutive E2M1 magnitudes: a magnitude's code is how many of them are at or below it (so a
# tie goes up, away from zero), and everything from 5 up saturates at 6.
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Every midpoint has at most two mantissa bits, so which side of each a float32 lies on shows in its sign,
# exponent and top two mantissa bits: its bits >> 21 index the code directly (2,048 entries).
_CODE_SHIFT = 21
# Output rows per slab at least: the slab's float32 values stay in cache between the passes.
_SLAB_ELEMENTS = 1 << 16


@per_device
def _table() -> ByteTable:
    """Each byte's two E2M1 values, low nibble first."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    every = torch.arange(256, dtype=torch.int64)
    return byte_table(torch.stack([lut[every & 0x0F], lut[every >> 4]], dim=1))


@per_device
def _powers() -> torch.Tensor:
    """``2^(s − 127)`` for each scale byte ``s`` (2^−127 is a float32 subnormal, exact; 255 is NaN)."""
    powers = torch.ldexp(torch.ones(256), torch.arange(-127, 129, dtype=torch.int32))
    powers[255] = math.nan
    return powers


@per_device
def _codes() -> torch.Tensor:
    """The E2M1 code (sign included, −0 as 8) of every float32 by its bits >> 21."""
    index = torch.arange(2048, dtype=torch.int64)
    smallest = (index << _CODE_SHIFT).to(torch.int32).view(torch.float32)  # the index's lowest float (wraps to sign)
    magnitude = torch.bucketize(smallest.abs(), torch.tensor(_THRESHOLDS), right=True, out_int32=True)
    return (magnitude | (torch.signbit(smallest).to(torch.int32) << 3)).to(torch.uint8)


def decoded_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The decoded tensor's shape for a ``_blocks`` tensor's shape ``[..., out, G, 16]``: ``[..., G · 32, out]``."""
    *lead, rows, groups, width = blocks_shape
    return (*lead, groups * width * 2, rows)


def _slab_rows(cols: int) -> int:
    return max(1, _SLAB_ELEMENTS // max(cols, 1))


def decode(blocks: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize ``blocks`` (uint8 ``[..., out, G, 16]``) with ``scales`` (uint8 ``[..., out, G]``) to float32
    ``[..., G · 32, out]`` (transformers' layout); ``out``, if given, is that contiguous buffer."""
    rows, groups, width = blocks.shape[-3:]
    cols = groups * width * 2
    device = blocks.device
    result = out if out is not None else torch.empty(decoded_shape(tuple(blocks.shape)), dtype=torch.float32,
                                                     device=device)
    flat_blocks = blocks.reshape(-1, rows, groups * width)
    flat_scales = scales.reshape(-1, rows, groups)
    flat_out = result.view(-1, cols, rows)
    step = _slab_rows(cols)
    scratch = torch.empty((min(step, rows), cols), dtype=torch.float32, device=device)
    powers, table = _powers(device), _table(device)
    index = torch.empty((min(step, rows) * groups,), dtype=torch.int32, device=device)
    for lead_index in range(flat_blocks.shape[0]):
        for a in range(0, rows, step):
            b = min(rows, a + step)
            values = scratch[: b - a]
            data = flat_blocks[lead_index, a:b].contiguous()
            decode_bytes(data, table, values)
            slab_index = index[: (b - a) * groups]
            slab_index.copy_(flat_scales[lead_index, a:b].reshape(-1))
            factors = torch.index_select(powers, 0, slab_index).view(b - a, groups, 1)
            values.view(b - a, groups, GROUP).mul_(factors)
            flat_out[lead_index, :, a:b].copy_(values.t())
    return result


def encode(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 ``[..., in, out]`` (transformers' layout; ``in`` a multiple of 32) to MXFP4: returns
    ``(blocks, scales)``, uint8 ``[..., out, in / 32, 16]`` and ``[..., out, in / 32]``."""
    *lead, cols, rows = values.shape
    if cols % GROUP:
        raise ValueError(f"MXFP4 groups 32 input values; {cols} is not a multiple of 32")
    groups = cols // GROUP
    device = values.device
    blocks = torch.empty((*lead, rows, groups, GROUP // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((*lead, rows, groups), dtype=torch.uint8, device=device)
    flat_in = values.reshape(-1, cols, rows)
    flat_blocks = blocks.view(-1, rows, groups * GROUP // 2)
    flat_scales = scales.view(-1, rows, groups)
    table = _codes(device)
    step = _slab_rows(cols)
    scratch = torch.empty((min(step, rows), cols), dtype=torch.float32, device=device)
    index = torch.empty((min(step, rows), cols), dtype=torch.int32, device=device)
    codes = torch.empty((min(step, rows), cols), dtype=torch.uint8, device=device)
    for lead_index in range(flat_in.shape[0]):
        for a in range(0, rows, step):
            b = min(rows, a + step)
            slab = scratch[: b - a]
            slab.copy_(flat_in[lead_index, :, a:b].t())
            grouped = slab.view(b - a, groups, GROUP)
            low, high = grouped.aminmax(dim=2)
            amax = torch.maximum(low.neg_(), high)
            # amax = m · 2^k, m in [0.5, 1): floor(log2(amax)) = k − 1, and e = that − 2.
            exponent = torch.frexp(amax)[1].sub_(3).clamp_(-127, 127)
            exponent.masked_fill_(amax == 0, -127)
            flat_scales[lead_index, a:b] = (exponent + 127).to(torch.uint8)
            grouped.mul_(torch.ldexp(torch.ones_like(amax), exponent.neg_()).unsqueeze(-1))
            slab_index = index[: b - a]
            torch.bitwise_right_shift(slab.view(torch.int32), _CODE_SHIFT, out=slab_index)
            slab_index.bitwise_and_(0x7FF)
            slab_codes = codes[: b - a]
            torch.index_select(table, 0, slab_index.view(-1), out=slab_codes.view(-1))
            pairs = slab_codes.view(b - a, -1, 2)
            torch.bitwise_left_shift(pairs[:, :, 1], 4, out=flat_blocks[lead_index, a:b])
            flat_blocks[lead_index, a:b].bitwise_or_(pairs[:, :, 0])
    return blocks, scales
