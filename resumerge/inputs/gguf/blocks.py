"""GGUF's F16, BF16 and Q8_0 tensors encoded and decoded with torch: vectorised over torch's compute threads, and
byte-equal to gguf-py's ``quants`` (llama.cpp's reference rounding), which is single-threaded numpy and was the run's
bound (bench/RESULTS.md, GGUF).

Q8_0 (``ggml-common.h`` ``block_q8_0``): each 32 values of a row are a block of 34 bytes, the scale
``d = max|x| / 127`` as float16 then 32 int8 ``q = round(x * (1/d))`` (a multiplication by the float32 reciprocal,
not a division; 0 where ``d`` is 0), rounded half away from zero. Every step is one IEEE float32 operation in the
same order as gguf-py's, so the bytes agree; ``tests/test_gguf_blocks.py`` checks them against gguf-py on ties, zeros,
huge and tiny values. BF16 is torch's round-to-nearest-even, with a NaN kept quiet and its high bits as gguf-py keeps
it. Values are float32 rows whose last dimension is whole blocks; the result is one row of bytes per value row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from resumerge.torch_import import torch

__all__ = ["BLOCKS", "decode", "encode"]

# ggml type ids this module encodes and decodes
F32, F16, Q8_0, BF16 = 0, 1, 8, 30
BLOCKS = frozenset({F32, F16, Q8_0, BF16})
_Q8_VALUES, _Q8_BYTES = 32, 34


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


def _q8_0(rows: torch.Tensor) -> torch.Tensor:
    from resumerge.torch_import import torch

    blocks = rows.reshape(-1, _Q8_VALUES)
    out = torch.empty((blocks.shape[0], _Q8_BYTES), dtype=torch.uint8)
    size = (min(_CHUNK, blocks.shape[0]), _Q8_VALUES)
    scratch = tuple(torch.empty(size) for _ in range(3))
    for start in range(0, blocks.shape[0], _CHUNK):
        _q8_0_chunk(blocks[start:start + _CHUNK], out[start:start + _CHUNK], scratch)
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // _Q8_VALUES * _Q8_BYTES)


def _bf16(rows: torch.Tensor) -> torch.Tensor:
    from resumerge.torch_import import torch

    bits = rows.to(torch.bfloat16).view(torch.int16)
    nan = rows.isnan()
    if bool(nan.any()):  # gguf-py keeps a NaN's sign and high mantissa bits and sets the quiet bit
        high = torch.bitwise_right_shift(rows.view(torch.int32), 16) | 0x40
        bits = torch.where(nan, high.to(torch.int16), bits)
    return bits


def encode(values: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``values`` (float32 on the CPU) stored as ``ggml_type``: float32 (F32), float16 (F16), bfloat16 bits as int16
    (BF16), or uint8 block bytes (Q8_0, ``values.shape[-1]`` whole blocks)."""
    from resumerge.torch_import import torch

    rows = values.to(torch.float32).contiguous()
    if ggml_type == F32:
        return rows
    if ggml_type == F16:
        return rows.to(torch.float16)
    if ggml_type == BF16:
        return _bf16(rows)
    if ggml_type == Q8_0:
        return _q8_0(rows)
    raise ValueError(f"ggml type {ggml_type} is not one this module encodes")


def decode(stored: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values of ``stored`` (as :func:`encode` returns it, or Q8_0 as any uint8/int8 block bytes), in
    ``out`` when given (float32, contiguous, of the values' shape)."""
    from resumerge.torch_import import torch

    if ggml_type in (F32, F16, BF16):
        plain = stored.view(torch.bfloat16) if ggml_type == BF16 and stored.dtype == torch.int16 else stored
        if out is None:
            return plain.to(torch.float32, copy=True)
        return out.copy_(plain)
    if ggml_type == Q8_0:
        raw = stored.contiguous().view(torch.uint8)
        shape = (*raw.shape[:-1], raw.shape[-1] // _Q8_BYTES * _Q8_VALUES)
        blocks = raw.reshape(-1, _Q8_BYTES)
        result = torch.empty(shape, dtype=torch.float32, device=raw.device) if out is None else out
        values = result.view(-1, _Q8_VALUES)
        for start in range(0, blocks.shape[0], _CHUNK):  # int8 widened in place, then scaled while in the cache
            chunk = blocks[start:start + _CHUNK]
            into = values[start:start + _CHUNK]
            into.copy_(chunk[:, 2:].view(torch.int8))
            into *= chunk[:, :2].contiguous().view(torch.float16).to(torch.float32)
        return result
    raise ValueError(f"ggml type {ggml_type} is not one this module decodes")
