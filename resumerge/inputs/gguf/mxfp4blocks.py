"""GGUF's MXFP4 (``block_mxfp4``: llama.cpp's for a mixture of experts' stacks, file type MXFP4_MOE): its block
layout, and its decoding with torch to the float32 values llama.cpp's ``dequantize_row_mxfp4`` (and gguf-py's
``quants``) give. The encoder is :mod:`resumerge.outputs.gguf.mxfp4quants`.

The same two facts as the safetensors MXFP4 of :mod:`resumerge.inputs.quant.mxfp4` (gpt-oss): a value is an E2M1
code (:data:`~resumerge.inputs.quant.mxfp4.E2M1_VALUES`) times a power of two, one E8M0 byte a block of 32. GGUF
lays them out otherwise: a 17-byte block is the E8M0 byte ``e`` first, then 16 bytes of codes, byte ``j`` holding
value ``j`` (low nibble) and value ``j + 16`` (high), where gpt-oss's byte holds two neighbours and its scales are a
separate tensor. llama.cpp computes a value as ``k * 2^(e - 128)`` with ``k`` the code's E2M1 value doubled (an
integer, ``kvalues_mxfp4``) and ``2^(e - 128)`` exact down to ``e`` 0 (a subnormal), so E8M0's 255 is ``2^127``
here, not NaN.

May import: torch (through :mod:`resumerge.machine.torch_import`), inputs.quant.mxfp4 (its E2M1 values), the ggml
types' table (:mod:`.ggmltypes`).
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import TYPE_CHECKING

from resumerge.inputs.gguf.ggmltypes import MXFP4

if TYPE_CHECKING:
    from resumerge.machine.torch_import import torch

__all__ = ["MXFP4_DECODERS", "kvalues"]


@functools.cache
def kvalues() -> tuple[int, ...]:
    """llama.cpp's ``kvalues_mxfp4``: each 4-bit code's E2M1 value doubled (0, 1, 2, 3, 4, 6, 8, 12, 0, -1 ...);
    imported when first used (the E2M1 values' module imports torch)."""
    from resumerge.inputs.quant.mxfp4 import E2M1_VALUES

    return tuple(int(2 * value) for value in E2M1_VALUES)


def _mxfp4_values(blocks: torch.Tensor, into: torch.Tensor) -> None:
    """MXFP4 blocks (n, 17) into float32 values (n, 32): ``k * 2^(e - 128)`` (an exact product, or ±inf where it
    overflows, as llama.cpp's)."""
    from resumerge.machine.torch_import import torch

    table = torch.tensor(kvalues(), dtype=torch.float32)
    codes = blocks[:, 1:17].to(torch.int64)
    values = into.view(-1, 2, 16)
    values[:, 0] = table[codes & 0x0F]
    values[:, 1] = table[codes >> 4]
    halves = torch.ldexp(torch.ones(256), torch.arange(-128, 128, dtype=torch.int32))  # 2^(e - 128), exact
    into *= halves[blocks[:, 0:1].to(torch.int64)]


# ggml type -> the function that decodes a run of its blocks
MXFP4_DECODERS = MappingProxyType({MXFP4: _mxfp4_values})
