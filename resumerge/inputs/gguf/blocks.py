"""GGUF's F16, BF16, Q8_0, K-quant (Q2_K ... Q6_K), 4-bit i-quant (IQ4_NL, IQ4_XS) and 3-bit i-quant (IQ3_XXS, IQ3_S,
their grids: :mod:`.iq3grid`) tensors (the 2-bit i-quants: :mod:`.iq2blocks`, the 1-bit ones: :mod:`.iq1blocks`,
TQ1_0 and TQ2_0: :mod:`.tqblocks`, MXFP4: :mod:`.mxfp4blocks`; the legacy Q4_0, Q4_1, Q5_0, Q5_1: :mod:`.legacy`)
decoded with torch,
vectorised over torch's compute threads, to the float32 values gguf-py's ``quants`` gives: each type's decoder
registered by its id (``_DECODERS``) against its row of :mod:`.ggmltypes`, whose block layouts (values and bytes a
block) the encoders of a GGUF output read too (:mod:`resumerge.outputs.gguf.encoders`).

Q8_0 (``ggml-common.h`` ``block_q8_0``): each 32 values of a row are a block of 34 bytes, a float16 scale ``d`` then
32 int8 codes ``q``; the value is ``d * q`` (an exact product). Values are float32 rows whose last dimension is whole
blocks; stored tensors are one row of bytes per value row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING

from resumerge.inputs.gguf import iq3grid, legacy
from resumerge.inputs.gguf.ggmltypes import (
    BF16,
    F16,
    F32,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPES,
)
from resumerge.inputs.gguf.iq1blocks import IQ1_DECODERS
from resumerge.inputs.gguf.iq2blocks import IQ2_DECODERS
from resumerge.inputs.gguf.mxfp4blocks import MXFP4_DECODERS
from resumerge.inputs.gguf.tqblocks import TQ_DECODERS

if TYPE_CHECKING:
    from resumerge.machine.torch_import import torch

__all__ = ["CHUNK", "IQ4_VALUES", "decode", "decodes"]

_Q8_VALUES = TYPES[Q8_0].values
# The 16 levels of IQ4_NL and IQ4_XS (ggml-common.h ``kvalues_iq4nl``), in increasing order: a 4-bit code is an
# index into them, times its block's scale
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


# blocks coded together (Q8_0's 7680 are 960 KiB of float32): in the cache, and under the allocator's 1 MiB mmap
# threshold (resumerge.machine.memory.allocator), so the temporaries come from the heap again rather than as fresh pages
CHUNK = 7680


def _q8_0_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q8_0 blocks (uint8, (n, 34)) into float32 values (n, 32): the int8 widened in place, then scaled while in the
    cache (an exact product: an f16 scale times an int8)."""
    from resumerge.machine.torch_import import torch

    into.copy_(blocks[:, 2:].view(torch.int8))
    into *= legacy.scales(blocks[:, :2])


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight sub-blocks' ``d*scale_j`` and ``dmin*min_j`` (n, 8, 1) of Q4_K or Q5_K blocks: f16 d and dmin, then
    12 bytes of eight 6-bit scales and mins."""
    from resumerge.machine.torch_import import torch

    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
    low, high, both = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    # sub-blocks 0-3 keep their 6 bits whole; 4-7 take 4 bits from ``both`` and their top 2 from the others' bytes
    scales = torch.cat([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], dim=1).to(torch.float32)
    mins = torch.cat([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], dim=1).to(torch.float32)
    return (d * scales).unsqueeze(-1), (dmin * mins).unsqueeze(-1)


def _q4_k_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q4_K blocks (``block_q4_K``: f16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles;
    (n, 144)) into float32 values (n, 256): sub-block j (32 values) is ``d*scale_j * q - dmin*min_j``, the two
    products exact and the difference rounded once, as gguf-py computes it. Nibble pair byte k of 32-byte group g
    holds sub-block 2g's value k (low) and sub-block 2g+1's (high)."""
    n = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    nibbles = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = into.view(n, 4, 2, 32)
    q[:, :, 0:1].copy_(nibbles & 0x0F)
    q[:, :, 1:2].copy_(nibbles >> 4)
    values = into.view(n, 8, 32)
    values *= scale
    values -= offset


def _q2_k_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q2_K blocks (``block_q2_K``: 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit codes, f16 d, dmin;
    (n, 84)) into float32 values (n, 256): sub-block j (16 values) is ``(d*scale_j) * q - dmin*min_j``; value
    ``128h + 32k + l`` has its code at bits 2k of byte ``32h + l``."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    scales = blocks[:, :16]
    d = blocks[:, 80:82].contiguous().view(torch.float16).to(torch.float32)
    dmin = blocks[:, 82:84].contiguous().view(torch.float16).to(torch.float32)
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    into.view(n, 2, 4, 32).copy_(torch.cat([(qs >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2))
    values = into.view(n, 16, 16)
    values *= (d * (scales & 0xF).to(torch.float32)).unsqueeze(-1)
    values -= (dmin * (scales >> 4).to(torch.float32)).unsqueeze(-1)


def _q3_k_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q3_K blocks (``block_q3_K``: 32 bytes of high bits, 64 of 2-bit codes, 12 of 6-bit scales, f16 d; (n, 110))
    into float32 values (n, 256): ``d*(scale_j - 32) * (q - 4)``, q's high bit of value e in bit ``e // 32`` of
    byte ``e % 32`` of the mask; scale j's low 4 bits in byte ``j % 8`` (high nibble for j >= 8), its top 2 in byte
    ``8 + j % 4`` at bits ``2 * (j // 4)``."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    hmask = blocks[:, :32].reshape(n, 1, 32)
    qs = blocks[:, 32:96].reshape(n, 2, 1, 32)
    packed = blocks[:, 96:108]
    d = blocks[:, 108:110].contiguous().view(torch.float16).to(torch.float32)
    low = torch.cat([packed[:, :8] & 0xF, packed[:, :8] >> 4], dim=1)
    high = torch.cat([(packed[:, 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1)
    scales = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    two = torch.cat([(qs >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2).reshape(n, 256)
    top = torch.cat([(hmask >> bit) & 1 for bit in range(8)], dim=1).reshape(n, 256)
    into.copy_(two.to(torch.int8) - ((top ^ 1) << 2).to(torch.int8))
    into.view(n, 16, 16).mul_((d * scales).unsqueeze(-1))


def _q5_k_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q5_K blocks (``block_q5_K``: f16 d and dmin, 12 bytes of scales and mins as Q4_K's, 32 bytes of fifth bits,
    128 of nibbles; (n, 176)) into float32 values (n, 256): as Q4_K, the fifth bit of sub-block j's value l in bit
    j of byte l."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    nibbles = blocks[:, 48:].reshape(n, 4, 1, 32)
    fifth = torch.cat([(qh >> bit) & 1 for bit in range(8)], dim=1).view(n, 4, 2, 32)
    q = into.view(n, 4, 2, 32)
    q.copy_(torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2) | (fifth << 4))
    values = into.view(n, 8, 32)
    values *= scale
    values -= offset


def _q6_k_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q6_K blocks (``block_q6_K``: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d;
    (n, 210)) into float32 values (n, 256): value p of each half h (128 values) has its low 4 bits from byte
    ``h*64 + p % 64`` (shifted by 4 for p >= 64) and its high 2 from byte ``h*32 + p % 32`` (shifted by 2 * (p // 32)),
    minus 32, times ``d * scale`` of its 16 values (an exact product, rounded once)."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    low = blocks[:, :128].reshape(n, 2, 1, 64)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32)
    nibble = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(n, 256)
    pair = torch.cat([(high >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2).reshape(n, 256)
    into.copy_(nibble | (pair << 4))
    into -= 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = blocks[:, 208:210].contiguous().view(torch.float16).to(torch.float32)
    values = into.view(n, 16, 16)
    values *= (d * scales).unsqueeze(-1)


def _iq4_levels(nibbles: torch.Tensor, into: torch.Tensor) -> None:
    """Groups of 16 bytes of 4-bit codes (n, g, 16) as their IQ4 levels into float32 ``into`` (n, g, 32): byte j
    holds value j (low nibble) and value j + 16 (high)."""
    from resumerge.machine.torch_import import torch

    levels = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    n, groups = nibbles.shape[:2]
    q = into.view(n, groups, 2, 16)
    q[:, :, 0] = levels[(nibbles & 0x0F).long()]
    q[:, :, 1] = levels[(nibbles >> 4).long()]


def _iq4_nl_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """IQ4_NL blocks (``block_iq4_nl``: f16 d, 16 bytes of 4-bit codes; (n, 18)) into float32 values (n, 32):
    ``d * level`` (an exact product)."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    _iq4_levels(blocks[:, 2:].reshape(n, 1, 16), into.view(n, 1, 32))
    into *= blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)


def _iq4_xs_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """IQ4_XS blocks (``block_iq4_xs``: f16 d, u16 ``scales_h``, 4 bytes ``scales_l``, 128 of 4-bit codes; (n,
    136)) into float32 values (n, 256): sub-block j (32 values, bytes ``8 + 16j`` on) is ``(d * (s_j - 32)) *
    level`` (the first product exact), the 6-bit ``s_j`` from nibble ``j % 2`` of ``scales_l[j // 2]`` and bits
    ``2j`` of ``scales_h`` (its top two)."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    high = blocks[:, 2:4].to(torch.int32)
    high = (high[:, 0:1] | (high[:, 1:2] << 8)) >> torch.arange(0, 16, 2, dtype=torch.int32)
    low = blocks[:, 4:8].to(torch.int32)
    low = torch.stack([low & 0x0F, low >> 4], dim=2).reshape(n, 8)
    scales = (low | ((high & 3) << 4)) - 32
    _iq4_levels(blocks[:, 8:].reshape(n, 8, 16), into.view(n, 8, 32))
    into.view(n, 8, 32).mul_((d * scales.to(torch.float32)).unsqueeze(-1))


def _iq3_points(size: int, magnitudes: tuple[int, ...]) -> torch.Tensor:
    """A 3-bit grid's points (:mod:`.iq3grid`) as their stored magnitudes, float32 (size, 4)."""
    from resumerge.machine.torch_import import torch

    table = torch.tensor(magnitudes, dtype=torch.float32)
    return table[torch.from_numpy(iq3grid.levels(size).astype("int64"))]


def _iq3_signed(points: torch.Tensor, index: torch.Tensor, signs: torch.Tensor, scale: torch.Tensor,
                into: torch.Tensor) -> None:
    """Blocks of 32 values into ``into`` (n, 8, 32): eight grid points by ``index`` (n, 8, 8), each value of 8 taken
    negative by bit j of its sign byte (``signs`` (n, 8, 4)), ``scale * magnitude`` (``scale`` (n, 8, 1)) then the
    sign (both exact but the first product)."""
    from resumerge.machine.torch_import import torch

    n = index.shape[0]
    magnitudes = points[index.long()].reshape(n, 8, 32)
    negative = (signs.unsqueeze(-1).to(torch.int32) >> torch.arange(8, dtype=torch.int32)) & 1
    torch.mul(magnitudes, scale, out=into)
    into.mul_(1 - 2 * negative.reshape(n, 8, 32).to(torch.float32))


def _iq3_xxs_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """IQ3_XXS blocks (``block_iq3_xxs``: f16 d, 64 grid indices, eight 32-bit words; (n, 98)) into float32 values
    (n, 256): block j's word holds four 7-bit sign groups (the eighth bit the parity of the seven) and its scale
    ``s`` in the top four bits; a value is ``((d * (0.5 + s)) * 0.5) * magnitude``, signed."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    words = blocks[:, 66:98].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # (n, 8)
    seven = (words.unsqueeze(-1) >> (7 * torch.arange(4))) & 127  # (n, 8, 4)
    parity = seven.clone()
    for shift in (4, 2, 1):
        parity ^= parity >> shift
    signs = seven | ((parity & 1) << 7)
    scale = (d * (0.5 + (words >> 28).to(torch.float32)) * 0.5).unsqueeze(-1)
    _iq3_signed(_iq3_points(256, iq3grid.XXS_MAGNITUDES), blocks[:, 2:66].reshape(n, 8, 8), signs, scale,
                into.view(n, 8, 32))


def _iq3_s_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """IQ3_S blocks (``block_iq3_s``: f16 d, 64 index bytes, 8 bytes of their high bits, 32 sign bytes, 4 bytes of
    4-bit scales; (n, 110)) into float32 values (n, 256): block j's point k has index ``qs[8j + k]`` plus bit k of
    ``qh[j]`` as its ninth, value ``8l + i`` of the block is negative by bit i of ``signs[4j + l]``, and a value is
    ``(d * (1 + 2 s_j)) * magnitude``, signed."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    high = (blocks[:, 66:74].to(torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1  # (n, 8, 8)
    index = blocks[:, 2:66].reshape(n, 8, 8).to(torch.int32) | (high << 8)
    nibbles = blocks[:, 106:110].to(torch.int32)
    steps = torch.stack([nibbles & 15, nibbles >> 4], dim=2).reshape(n, 8)
    scale = (d * (1 + 2 * steps).to(torch.float32)).unsqueeze(-1)
    _iq3_signed(_iq3_points(512, iq3grid.S_MAGNITUDES), index, blocks[:, 74:106].reshape(n, 8, 4), scale,
                into.view(n, 8, 32))


# ggml type -> the function that decodes a run of its blocks (its row: resumerge.inputs.gguf.ggmltypes)
_DECODERS: Mapping[int, Callable[[torch.Tensor, torch.Tensor], None]] = MappingProxyType({
    Q8_0: _q8_0_values, Q2_K: _q2_k_values, Q3_K: _q3_k_values, Q4_K: _q4_k_values, Q5_K: _q5_k_values,
    Q6_K: _q6_k_values, IQ4_NL: _iq4_nl_values, IQ4_XS: _iq4_xs_values, IQ3_XXS: _iq3_xxs_values,
    IQ3_S: _iq3_s_values, **IQ2_DECODERS, **IQ1_DECODERS, **TQ_DECODERS, **MXFP4_DECODERS,
    **{kind: partial(legacy.decode_blocks, kind=legacy.KINDS[kind]) for kind in legacy.KINDS}})


def decodes(ggml_type: int) -> bool:
    """Whether :func:`decode` decodes ``ggml_type`` (a plain type, or a block type with its decoder here)."""
    return ggml_type in (F32, F16, BF16) or ggml_type in _DECODERS


def decode(stored: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values of ``stored`` (as :func:`resumerge.outputs.gguf.encoders.encode` returns it, or a block
    type as any uint8/int8 block bytes), in
    ``out`` when given (float32, contiguous, of the values' shape)."""
    from resumerge.machine.torch_import import torch

    if ggml_type in (F32, F16, BF16):
        plain = stored.view(torch.bfloat16) if ggml_type == BF16 and stored.dtype == torch.int16 else stored
        if out is None:
            return plain.to(torch.float32, copy=True)
        return out.copy_(plain)
    if ggml_type in _DECODERS:
        values_per_block, size = TYPES[ggml_type].block
        raw = stored.contiguous().view(torch.uint8)
        shape = (*raw.shape[:-1], raw.shape[-1] // size * values_per_block)
        blocks = raw.reshape(-1, size)
        result = torch.empty(shape, dtype=torch.float32, device=raw.device) if out is None else out
        values = result.view(-1, values_per_block)
        step = CHUNK * _Q8_VALUES // values_per_block  # the same values per chunk, whatever the block
        for start in range(0, blocks.shape[0], step):
            _DECODERS[ggml_type](blocks[start:start + step], values[start:start + step])
        return result
    raise ValueError(f"ggml type {ggml_type} is not one this module decodes")
