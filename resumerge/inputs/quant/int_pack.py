"""compressed-tensors' packing of 2-, 4- and 8-bit integers into int32 words (``pack-quantized``).

Along the last dimension, element ``i`` of a row goes to bits ``bits · (i mod per)`` of word ``i // per``
(``per = 32 / bits``), least significant first, stored **offset binary**: the value ``v`` is kept as
``v + 2^(bits−1)`` (INT4 −8…7 as nibbles 0…15, vLLM's ``uint4b8``), never two's complement. A row of ``cols``
values takes ``ceil(cols · bits / 32)`` words; the slots past ``cols`` in the last word hold 0 (not the offset),
as ``compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32`` pads. Zero points of asymmetric
group/channel weights are packed the same way along the rows (dimension 0).

For 3, 5, 6 and 7 bits compressed-tensors 0.20 packs densely across words while older releases padded each word;
those widths are refused before they get here (:data:`PACKABLE_BITS`).
"""

from __future__ import annotations

import sys

from resumerge.inputs.quant.byte_tables import ByteTable, byte_table, decode_bytes, per_device
from resumerge.machine.torch_import import torch

__all__ = ["PACKABLE_BITS", "decode_words", "pack", "packed_cols", "unpack"]

PACKABLE_BITS = (2, 4, 8)


def packed_cols(cols: int, bits: int) -> int:
    """Words per row for ``cols`` values of ``bits`` bits."""
    return -(-cols * bits // 32)


def _check(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"pack-quantized widths are {PACKABLE_BITS}, not {bits}")
    return 32 // bits


@per_device
def _table(bits: int) -> ByteTable:
    """Byte ``b`` holds ``8 / bits`` values, lowest bits first, each minus the offset."""
    per = 8 // bits
    every = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    values = (every >> shifts) & ((1 << bits) - 1)
    return byte_table((values - (1 << (bits - 1))).to(torch.float32))


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """The words' bytes in value order (least significant first), whatever the host's byte order."""
    # Through 1-D: a [n, 1] transposed view passes as contiguous with a last stride other than 1.
    data = words.contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder == "big":
        data = data.view(-1, 4).flip(-1).contiguous()
    return data.view(words.shape[0], -1)


def decode_words(words: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Write the signed values of ``[n, w]`` int32 ``words`` into float32 ``out`` (``[n, w · 32 / bits]``,
    contiguous), padding slots included. Returns ``out``."""
    _check(bits)
    if words.dtype != torch.int32:
        # Any other width would fill only part of ``out`` and leave the rest as it was (uninitialised memory).
        raise ValueError(f"packed words are int32, not {words.dtype}")
    data = _bytes(words)
    decode_bytes(data, _table(data.device, bits), out)
    return out


def unpack(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The ``[n, cols]`` int8 values packed in ``[n, w]`` int32 ``words``."""
    per = _check(bits)
    n, w = words.shape
    values = torch.empty((n, w * per), dtype=torch.float32, device=words.device)
    decode_words(words, bits, values)
    return values[:, :cols].to(torch.int8)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[n, cols]`` integer ``values`` (within ``bits`` bits, signed) into ``[n, packed_cols]`` int32 words,
    exactly as compressed-tensors does (offset binary, zero padding)."""
    per = _check(bits)
    n, cols = values.shape
    w = packed_cols(cols, bits)
    stored = torch.zeros((n, w * per), dtype=torch.uint8, device=values.device)
    body = stored[:, :cols]
    body.copy_(values)  # two's complement bytes: adding the offset modulo 256 gives v + offset
    body.add_(1 << (bits - 1))
    per_byte = 8 // bits
    lanes = stored.view(n, w * 4, per_byte)
    data = lanes[:, :, 0].clone()
    for k in range(1, per_byte):
        data.bitwise_or_(lanes[:, :, k] << (bits * k))
    if sys.byteorder == "big":
        data = data.view(n, w, 4).flip(-1).contiguous()
    return data.view(n, w * 4).view(torch.int32)
