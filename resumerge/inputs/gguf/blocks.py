"""GGUF's F16, BF16 and Q8_0 tensors (and the legacy Q4_0, Q4_1, Q5_0, Q5_1: :mod:`.legacy`) encoded and decoded
with torch, Q4_K and Q6_K decoded: vectorised over torch's compute threads, and byte-equal to gguf-py's ``quants``
(llama.cpp's reference rounding), which is single-threaded numpy and was the run's bound (bench/RESULTS.md, GGUF).

Q8_0 (``ggml-common.h`` ``block_q8_0``): each 32 values of a row are a block of 34 bytes, the scale
``d = max|x| / 127`` as float16 then 32 int8 ``q = round(x * (1/d))`` (a multiplication by the float32 reciprocal,
not a division; 0 where ``d`` is 0), rounded half away from zero. Every step is one IEEE float32 operation in the
same order as gguf-py's, so the bytes agree; ``tests/test_gguf_blocks.py`` checks them against gguf-py on ties, zeros,
huge and tiny values. BF16 is torch's round-to-nearest-even, with a NaN kept quiet and its high bits as gguf-py keeps
it. Values are float32 rows whose last dimension is whole blocks; the result is one row of bytes per value row.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from resumerge.inputs.gguf import legacy

if TYPE_CHECKING:
    from resumerge.torch_import import torch

__all__ = ["decode", "encode"]

# ggml type ids this module encodes and decodes
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 14, 30
_Q8_VALUES, _Q8_BYTES = 32, 34
# ggml type -> (values, bytes) of a block, for every block type this module encodes or decodes
BLOCK_BYTES = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (_Q8_VALUES, _Q8_BYTES),
               Q4_K: (256, 144), Q6_K: (256, 210)}


# Q8_0 blocks coded together: 960 KiB of float32, in the cache, and under the allocator's 1 MiB mmap threshold
# (resumerge.memory.allocator), so the temporaries come from the heap again rather than as fresh pages
_CHUNK = 7680


def _q8_0_chunk(blocks: torch.Tensor, out: torch.Tensor, scratch: tuple[torch.Tensor, ...]) -> None:
    """Q8_0 bytes of ``blocks`` (float32, (n, 32)) into ``out`` (uint8, (n, 34)), the temporaries in ``scratch``
    (three float32 buffers of at least n blocks), every step in place or into them: no temporary of a chunk's size
    (a bool mask added to a float one is cast into one)."""
    from resumerge.torch_import import torch

    n = blocks.shape[0]
    a, y, whole = (buffer[:n] for buffer in scratch)
    torch.abs(blocks, out=a)
    d = a.amax(dim=1, keepdim=True)
    d /= torch.full_like(d, 127.0)  # a true division (a scalar divisor may become a reciprocal multiply)
    inverse = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    torch.mul(blocks, inverse, out=y)
    # round half away from zero, exactly (floor(|y| + 0.5) is not: the addition rounds 0.49999997 up)
    torch.abs(y, out=a)
    torch.floor(a, out=whole)
    a -= whole  # the fraction, exact in float32; doubled (exact) and floored it is 1 from a half up, else 0
    a *= 2
    whole += a.floor_()
    torch.copysign(whole, y, out=whole)
    out[:, :2] = d.to(torch.float16).view(torch.uint8)
    out[:, 2:].view(torch.int8).copy_(whole)


def _q8_0(rows: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    from resumerge.torch_import import torch

    blocks = rows.reshape(-1, _Q8_VALUES)
    out = torch.empty((blocks.shape[0], _Q8_BYTES), dtype=torch.uint8) if into is None else \
        into.view(torch.uint8).view(-1, _Q8_BYTES)
    size = (min(_CHUNK, blocks.shape[0]), _Q8_VALUES)
    scratch = tuple(torch.empty(size) for _ in range(3))
    for start in range(0, blocks.shape[0], _CHUNK):
        _q8_0_chunk(blocks[start:start + _CHUNK], out[start:start + _CHUNK], scratch)
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // _Q8_VALUES * _Q8_BYTES)


def _legacy(rows: torch.Tensor, ggml_type: int, into: torch.Tensor | None = None) -> torch.Tensor:
    from resumerge.torch_import import torch

    kind = legacy.KINDS[ggml_type]
    blocks = rows.reshape(-1, _Q8_VALUES)
    out = torch.empty((blocks.shape[0], kind.size), dtype=torch.uint8) if into is None else \
        into.view(torch.uint8).view(-1, kind.size)
    size = (min(_CHUNK, blocks.shape[0]), _Q8_VALUES)
    scratch = (torch.empty(size), torch.empty(size))
    for start in range(0, blocks.shape[0], _CHUNK):
        legacy.encode_blocks(blocks[start:start + _CHUNK], out[start:start + _CHUNK], kind, scratch)
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // _Q8_VALUES * kind.size)


def _bf16(rows: torch.Tensor) -> torch.Tensor:
    from resumerge.torch_import import torch

    bits = rows.to(torch.bfloat16).view(torch.int16)
    nan = rows.isnan()
    if bool(nan.any()):  # gguf-py keeps a NaN's sign and high mantissa bits and sets the quiet bit
        high = torch.bitwise_right_shift(rows.view(torch.int32), 16) | 0x40
        bits = torch.where(nan, high.to(torch.int16), bits)
    return bits


def encode(values: torch.Tensor, ggml_type: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` (float32 on the CPU) stored as ``ggml_type``: float32 (F32), float16 (F16), bfloat16 bits as int16
    (BF16), or uint8 block bytes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: ``values.shape[-1]`` whole blocks); a block type
    written straight into ``into`` when given (contiguous, of the result's bytes), the others copied there."""
    from resumerge.torch_import import torch

    rows = values.to(torch.float32).contiguous()
    if ggml_type == Q8_0:
        return _q8_0(rows, into)
    if ggml_type in legacy.KINDS:
        return _legacy(rows, ggml_type, into)
    if ggml_type == F32:
        stored = rows
    elif ggml_type == F16:
        stored = rows.to(torch.float16)
    elif ggml_type == BF16:
        stored = _bf16(rows)
    else:
        raise ValueError(f"ggml type {ggml_type} is not one this module encodes")
    if into is not None:
        into.view(stored.dtype).copy_(stored.reshape(into.shape))
        return into
    return stored


def _q8_0_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q8_0 blocks (uint8, (n, 34)) into float32 values (n, 32): the int8 widened in place, then scaled while in the
    cache (an exact product: an f16 scale times an int8)."""
    from resumerge.torch_import import torch

    into.copy_(blocks[:, 2:].view(torch.int8))
    into *= legacy.scales(blocks[:, :2])


def _q4_k_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q4_K blocks (``block_q4_K``: f16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles;
    (n, 144)) into float32 values (n, 256): sub-block j (32 values) is ``d*scale_j * q - dmin*min_j``, the two
    products exact and the difference rounded once, as gguf-py computes it. Nibble pair byte k of 32-byte group g
    holds sub-block 2g's value k (low) and sub-block 2g+1's (high)."""
    from resumerge.torch_import import torch

    n = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
    low, high, both = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    # sub-blocks 0-3 keep their 6 bits whole; 4-7 take 4 bits from ``both`` and their top 2 from the others' bytes
    scales = torch.cat([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], dim=1).to(torch.float32)
    mins = torch.cat([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], dim=1).to(torch.float32)
    scale = (d * scales).unsqueeze(-1)
    offset = (dmin * mins).unsqueeze(-1)
    nibbles = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = into.view(n, 4, 2, 32)
    q[:, :, 0:1].copy_(nibbles & 0x0F)
    q[:, :, 1:2].copy_(nibbles >> 4)
    values = into.view(n, 8, 32)
    values *= scale
    values -= offset


def _q6_k_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """Q6_K blocks (``block_q6_K``: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d;
    (n, 210)) into float32 values (n, 256): value p of each half h (128 values) has its low 4 bits from byte
    ``h*64 + p % 64`` (shifted by 4 for p >= 64) and its high 2 from byte ``h*32 + p % 32`` (shifted by 2 * (p // 32)),
    minus 32, times ``d * scale`` of its 16 values (an exact product, rounded once)."""
    from resumerge.torch_import import torch

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


# ggml type -> the function that decodes a run of its blocks
_DECODERS: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    Q8_0: _q8_0_values, Q4_K: _q4_k_values, Q6_K: _q6_k_values,
    **{kind: partial(legacy.decode_blocks, kind=legacy.KINDS[kind]) for kind in legacy.KINDS}}


def decode(stored: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values of ``stored`` (as :func:`encode` returns it, or Q8_0 as any uint8/int8 block bytes), in
    ``out`` when given (float32, contiguous, of the values' shape)."""
    from resumerge.torch_import import torch

    if ggml_type in (F32, F16, BF16):
        plain = stored.view(torch.bfloat16) if ggml_type == BF16 and stored.dtype == torch.int16 else stored
        if out is None:
            return plain.to(torch.float32, copy=True)
        return out.copy_(plain)
    if ggml_type in BLOCK_BYTES:
        values_per_block, size = BLOCK_BYTES[ggml_type]
        raw = stored.contiguous().view(torch.uint8)
        shape = (*raw.shape[:-1], raw.shape[-1] // size * values_per_block)
        blocks = raw.reshape(-1, size)
        result = torch.empty(shape, dtype=torch.float32, device=raw.device) if out is None else out
        values = result.view(-1, values_per_block)
        step = _CHUNK * _Q8_VALUES // values_per_block  # the same values per chunk, whatever the block
        for start in range(0, blocks.shape[0], step):
            _DECODERS[ggml_type](blocks[start:start + step], values[start:start + step])
        return result
    raise ValueError(f"ggml type {ggml_type} is not one this module decodes")
