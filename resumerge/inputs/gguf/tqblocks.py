"""GGUF's ternary types (TQ1_0, TQ2_0: llama.cpp's for BitNet b1.58-like weights, each value -1, 0 or 1 times its
super-block's scale): their block layouts, and their decoding with torch to the float32 values llama.cpp's
``dequantize_row_tq1_0``/``_tq2_0`` (and gguf-py's ``quants``) give. The encoder is
:mod:`resumerge.outputs.gguf.tquants`.

A super-block is 256 values with one float16 ``d`` (its largest magnitude); a value is ``(t - 1) * d`` for its
trit ``t`` (0, 1, 2 for -1, 0, 1).

- TQ2_0 (66 bytes, 2.0625 bits a value): 64 bytes of 2-bit trits, then ``d``. Byte ``32h + m`` holds value
  ``128h + 32n + m`` at bits ``2n``.
- TQ1_0 (54 bytes, 1.6875 bits a value): 48 bytes of five trits each, 4 bytes of four, then ``d``. A byte's trits
  are a base-3 number (the first trit most significant; a four-trit byte's number times 3), stored scaled to
  ``ceil(q * 256 / 243)``: trit ``n`` is then ``((byte * 3^n mod 256) * 3) >> 8``, multiplications only. The first
  32 bytes hold values ``32n + m`` (byte m, trit n), the next 16 values ``160 + 16n + m``, the last 4 values
  ``240 + 4n + j``.

May import: torch (through :mod:`resumerge.machine.torch_import`), the ggml types' table (:mod:`.ggmltypes`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from resumerge.inputs.gguf.ggmltypes import TQ1_0, TQ2_0

if TYPE_CHECKING:
    from resumerge.machine.torch_import import torch

__all__ = ["TQ_DECODERS"]


def _scaled(trits: torch.Tensor, blocks: torch.Tensor, into: torch.Tensor) -> None:
    """``into`` (n, 256) = ``(trits - 1) * d``, ``d`` the float16 in each block's last two bytes (an exact
    product)."""
    from resumerge.machine.torch_import import torch

    d = blocks[:, -2:].contiguous().view(torch.float16).to(torch.float32)
    into.copy_(trits.reshape(into.shape))
    into -= 1
    into *= d


def _tq2_0_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """TQ2_0 blocks (n, 66) into float32 values (n, 256)."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    qs = blocks[:, :64].reshape(n, 2, 1, 32)
    _scaled(torch.cat([(qs >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2), blocks, into)


def _trits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` trits (n, count, bytes) of TQ1_0's scaled base-3 bytes ``packed`` (n, bytes)."""
    from resumerge.machine.torch_import import torch

    wide = packed.to(torch.int32).unsqueeze(1)
    powers = torch.tensor([3 ** k for k in range(count)], dtype=torch.int32).view(1, count, 1)
    return (((wide * powers) & 0xFF) * 3) >> 8


def _tq1_0_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """TQ1_0 blocks (n, 54) into float32 values (n, 256)."""
    from resumerge.machine.torch_import import torch

    n = blocks.shape[0]
    trits = torch.cat([_trits(blocks[:, :32], 5).reshape(n, 160), _trits(blocks[:, 32:48], 5).reshape(n, 80),
                       _trits(blocks[:, 48:52], 4).reshape(n, 16)], dim=1)
    _scaled(trits, blocks, into)


# ggml type -> the function that decodes a run of its blocks
TQ_DECODERS = MappingProxyType({TQ1_0: _tq1_0_values, TQ2_0: _tq2_0_values})
