"""GGUF's legacy 32-value block types Q4_0, Q4_1, Q5_0 and Q5_1 decoded with torch to the float32 values gguf-py's
``quants`` gives; their encoders (llama.cpp's reference rounding) are a GGUF output's
(:mod:`resumerge.outputs.gguf.encoders`), which share the layouts here (:data:`KINDS`).

Each 32 values of a row are one block (``ggml-common.h``): a float16 scale ``d``, for the affine types Q4_1/Q5_1 a
float16 offset ``m``, for the 5-bit types Q5_0/Q5_1 four bytes whose bit j (a little-endian u32) is bit 4 of code
j, and 16 bytes whose byte k holds code k's low nibble and code k+16's in its high one.

- Q4_0 / Q5_0 (symmetric, 16 / 32 levels): ``x = d * (q - 8)`` (``16``).
- Q4_1 / Q5_1 (affine): ``x = d * q + m``.

Decoding is exact products and one rounded sum, as gguf-py's, so the float32 values agree bit for bit (NaN payloads
included).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from resumerge.inputs.gguf.ggmltypes import Q4_0, Q4_1, Q5_0, Q5_1

if TYPE_CHECKING:
    from resumerge.machine.torch_import import torch

__all__ = ["KINDS", "Kind", "decode_blocks", "scales"]

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


# ggml type id -> its kind (its block's values and bytes: its row in resumerge.inputs.gguf.ggmltypes)
KINDS = MappingProxyType({Q4_0: Kind(15, False), Q4_1: Kind(15, True), Q5_0: Kind(31, False), Q5_1: Kind(31, True)})


def scales(raw: torch.Tensor) -> torch.Tensor:
    """Float16 scales (uint8, (n, 2)) as float32 ((n, 1)), a NaN's sign and payload kept as numpy keeps them
    (torch's conversion makes every NaN its one quiet NaN)."""
    from resumerge.machine.torch_import import torch

    half = raw.contiguous().view(torch.float16)
    value = half.to(torch.float32)
    nan = value.isnan()
    if bool(nan.any()):
        bits = half.view(torch.int16).to(torch.int32)
        widened = (bits & -0x8000) << 16 | 0x7F800000 | (bits & 0x03FF) << 13
        value = torch.where(nan, widened.view(torch.float32), value)
    return value


def decode_blocks(blocks: torch.Tensor, into: torch.Tensor, kind: Kind) -> None:
    """``blocks`` (uint8, (n, the type's block bytes)) as float32 values into ``into`` ((n, 32)): the codes written
    in place, then scaled (an exact product: a float16 scale times a code of at most 5 bits) and offset."""
    from resumerge.machine.torch_import import torch

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
