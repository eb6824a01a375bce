"""GGUF's legacy 32-value block types Q4_0, Q4_1, Q5_0 and Q5_1 encoded and decoded with torch, byte-equal to
gguf-py's ``quants`` (llama.cpp's reference rounding, ``ggml-quants.c`` ``quantize_row_q4_0_ref``...).

Each 32 values of a row are one block (``ggml-common.h``): a float16 scale ``d``, for the affine types Q4_1/Q5_1 a
float16 offset ``m``, for the 5-bit types Q5_0/Q5_1 four bytes whose bit j (a little-endian u32) is bit 4 of code
j, and 16 bytes whose byte k holds code k's low nibble and code k+16's in its high one.

- Q4_0 / Q5_0 (symmetric, 16 / 32 levels): ``d = x_m / -8`` (``-16``) where ``x_m`` is the block's first value of
  the largest magnitude, ``q = trunc(x * (1/d) + 8.5)`` (``16.5``) clipped to 15 (31); ``x = d * (q - 8)`` (``16``).
- Q4_1 / Q5_1 (affine): ``d = (max - min) / 15`` (``31``), ``m = min``, ``q = trunc((x - min) * (1/d) + 0.5)``
  clipped; ``x = d * q + m``.

``1/d`` is 0 where ``d`` is 0. Every step is one IEEE float32 operation in gguf-py's order, and a code outside
0..255 (only from a scale that under- or overflows) is cast as numpy casts float32 to uint8 on x86 (through int32:
0 for NaN, infinities and 2**31 or more; else the low byte), so the bytes agree on every finite input. One
difference, by choice: where a block's max or min is a zero present with both signs, gguf-py's numpy returns the
zero its SIMD lanes meet last (it differs between machines); this module takes the first, as llama.cpp's loop does,
so only the sign bit of a zero ``d`` or ``m`` can differ. Decoding is exact products and one rounded sum, as
gguf-py's, so the float32 values agree bit for bit (NaN payloads included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from resumerge.torch_import import torch

__all__ = ["KINDS", "decode_blocks", "encode_blocks", "scales"]

_VALUES = 32


@dataclass(frozen=True)
class Kind:
    """A legacy block type: its largest code (15 or 31) and whether it stores an offset ``m`` (Q4_1, Q5_1)."""

    levels: int
    affine: bool

    @property
    def high_at(self) -> int:
        """The byte offset of the four high-bit bytes (5-bit types)."""
        return 4 if self.affine else 2

    @property
    def size(self) -> int:
        return 2 + 2 * self.affine + 4 * (self.levels == 31) + 16


# ggml type id -> its kind
KINDS = {2: Kind(15, False), 3: Kind(15, True), 6: Kind(31, False), 7: Kind(31, True)}


def _codes(blocks: torch.Tensor, kind: Kind, y: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The codes (uint8, (n, 32)) of ``blocks`` (float32, (n, 32)), with ``d`` and ``m`` ((n, 1) float32; ``m`` is
    ``d`` for a symmetric kind); ``y`` and ``a`` are float32 scratch of the blocks' shape."""
    from resumerge.torch_import import torch

    # amin and amax are fast; which of equal extremes (only zeros of both signs differ) or of equal magnitudes of
    # both signs is taken matters, so blocks with such a tie (or a NaN) take the first, as llama.cpp does: argmin
    # and argmax give the first index (10x slower, so only when some block needs it)
    low, high = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    if kind.affine:
        tied = (low == 0) | (high == 0) | low.isnan()
        if bool(tied.any()):
            low = torch.where(tied, blocks.gather(1, blocks.argmin(1, keepdim=True)), low)
            high = torch.where(tied, blocks.gather(1, blocks.argmax(1, keepdim=True)), high)
        d = (high - low) / torch.full_like(low, kind.levels)  # a true division, not a reciprocal multiply
        torch.sub(blocks, low, out=y)
        offset, m = 0.5, low
    else:
        half = (kind.levels + 1) // 2
        peak = torch.where(high > -low, high, low)  # the extreme of the larger magnitude
        tied = ~((high > -low) | (-low > high))  # equal magnitudes of both signs (zeros too), or a NaN
        if bool(tied.any()):
            torch.abs(blocks, out=a)
            peak = torch.where(tied, blocks.gather(1, a.argmax(1, keepdim=True)), peak)
        d = peak / torch.full_like(peak, -half)
        y.copy_(blocks)
        offset, m = half + 0.5, d
    y *= torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    y += offset
    y.trunc_()
    if bool((y.amin() >= 0) & (y.amax() < 256)):  # every code a byte already (no NaN): clipped as numpy clips
        return y.clamp_(max=kind.levels).to(torch.uint8), d, m
    # numpy's float32 -> uint8 cast on x86: through int32 (0 for NaN, ±inf, |v| >= 2**31), then the low byte
    torch.abs(y, out=a)
    codes = torch.where(a < 2.0**31, y, torch.zeros_like(y)).to(torch.int32)
    codes &= 0xFF
    return codes.clamp_(max=kind.levels).to(torch.uint8), d, m


def encode_blocks(blocks: torch.Tensor, out: torch.Tensor, kind: Kind, scratch: tuple[torch.Tensor, ...]) -> None:
    """The bytes of ``blocks`` (float32, (n, 32)) as ``kind`` into ``out`` (uint8, (n, kind.size)), the
    temporaries in ``scratch`` (two float32 buffers of at least n blocks)."""
    from resumerge.torch_import import torch

    n = blocks.shape[0]
    y, a = (buffer[:n] for buffer in scratch)
    codes, d, m = _codes(blocks, kind, y, a)
    out[:, -16:].copy_((codes[:, :16] & 0x0F) | ((codes[:, 16:] & 0x0F) << 4))
    if kind.levels == 31:
        weights = torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8)
        bits = (codes >> 4).view(n, 4, 8) * weights
        out[:, kind.high_at:kind.high_at + 4] = bits.sum(dim=2, dtype=torch.uint8)
    out[:, :2] = d.to(torch.float16).view(torch.uint8)
    if kind.affine:
        out[:, 2:4] = m.to(torch.float16).view(torch.uint8)


def scales(raw: torch.Tensor) -> torch.Tensor:
    """Float16 scales (uint8, (n, 2)) as float32 ((n, 1)), a NaN's sign and payload kept as numpy keeps them
    (torch's conversion makes every NaN its one quiet NaN)."""
    from resumerge.torch_import import torch

    half = raw.contiguous().view(torch.float16)
    value = half.to(torch.float32)
    nan = value.isnan()
    if bool(nan.any()):
        bits = half.view(torch.int16).to(torch.int32)
        widened = (bits & -0x8000) << 16 | 0x7F800000 | (bits & 0x03FF) << 13
        value = torch.where(nan, widened.view(torch.float32), value)
    return value


def decode_blocks(blocks: torch.Tensor, into: torch.Tensor, kind: Kind) -> None:
    """``blocks`` (uint8, (n, kind.size)) as float32 values into ``into`` ((n, 32)): the codes written in place,
    then scaled (an exact product: a float16 scale times a code of at most 5 bits) and offset."""
    from resumerge.torch_import import torch

    n = blocks.shape[0]
    nibbles = blocks[:, -16:]
    codes = into.view(n, 2, 16)
    codes[:, 0].copy_(nibbles & 0x0F)
    codes[:, 1].copy_(nibbles >> 4)
    if kind.levels == 31:
        shifts = torch.arange(8, dtype=torch.uint8)
        high = (blocks[:, kind.high_at:kind.high_at + 4].unsqueeze(-1) >> shifts) & 1
        into += high.view(n, _VALUES) * 16
    d = scales(blocks[:, :2])
    if kind.affine:
        into *= d
        into += scales(blocks[:, 2:4])
    else:
        into -= (kind.levels + 1) // 2
        into *= d
