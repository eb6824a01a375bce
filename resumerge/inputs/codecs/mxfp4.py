"""The MXFP4 codec (gpt-oss experts): ``X_blocks`` (two E2M1 codes per byte) with ``X_scales`` (one power of two
per 32 input values), decoded to transformers' ``[experts, in, out]`` layout by :mod:`resumerge.inputs.quant.mxfp4`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.protocol import MAIN, OutPart
from resumerge.inputs.codecs.quantized import SCALE, QuantizedCodec
from resumerge.inputs.quant import mxfp4
from resumerge.inputs.quant.refusals import HeaderMap, refuse
from resumerge.inputs.quant.verdict import QuantizedTensor, Scheme
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource


@dataclass(frozen=True)
class Mxfp4Codec(QuantizedCodec):
    """``quant_method: mxfp4``: ``X`` is ``X_blocks`` ``[experts, out, G, 16]`` with ``X_scales`` ``[experts, out,
    G]``, valued ``[experts, G · 32, out]`` in float32. Its rows are experts, whole in every part."""

    name: ClassVar[str] = "mxfp4"
    claims: ClassVar[tuple[str, ...]] = ("mxfp4",)

    @classmethod
    def weights(cls, quantization: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
        """Every ``X_blocks`` with its ``X_scales`` of a ``quant_method: mxfp4`` model."""
        return _mxfp4_weights(headers, source)

    @classmethod
    def codec_of(cls, tensors: Mapping[str, TensorSource]) -> Callable[[QuantizedTensor], Mxfp4Codec]:
        return cls.of

    @classmethod
    def of(cls, weight: QuantizedTensor) -> Mxfp4Codec:
        """The codec of one recognised weight; refuses a weight without a leading experts dimension, whose decoded
        rows (input features) are not its blocks' rows (output features)."""
        if weight.shape is None or len(weight.shape) < 3:
            raise ModelInputError(f"mxfp4 blocks {weight.codes} have no experts dimension; resumerge decodes "
                                  "gpt-oss-style [experts, out, groups, 16] blocks", tensor=weight.codes)
        return cls()

    @property
    def stored_as(self) -> str:
        return "packed MXFP4 bytes"

    def value_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return mxfp4.decoded_shape(stored)

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return mxfp4.decode(parts[MAIN], parts[SCALE], out=out)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        *lead, cols, rows = shape
        groups = cols // mxfp4.GROUP
        return (OutPart(MAIN, f"{name}_blocks", "U8", (*lead, rows, groups, mxfp4.GROUP // 2)),
                OutPart(SCALE, f"{name}_scales", "U8", (*lead, rows, groups)))

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """Fresh power-of-two scales and E2M1 codes (the input width must be a multiple of 32)."""
        blocks, scales = mxfp4.encode(value.to(torch.float32))
        return {MAIN: blocks, SCALE: scales}


def _mxfp4_weights(headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
    found: dict[str, QuantizedTensor] = {}
    for blocks_name in sorted(n for n in headers if n.endswith("_blocks")):
        name = blocks_name.removesuffix("_blocks")
        scales_name = f"{name}_scales"
        dtype, shape = headers[blocks_name]
        if scales_name not in headers:
            raise refuse(source, f"an mxfp4 weight without its scales (looked for {scales_name})", blocks_name,
                         "the checkpoint is incomplete: download it again")
        scale_dtype, scale_shape = headers[scales_name]
        if dtype != "U8" or scale_dtype != "U8" or len(shape) < 3 or shape[-1] != 16:
            raise refuse(source, f"mxfp4 blocks are U8 [..., out, groups, 16] with U8 scales, not {dtype} "
                                 f"{list(shape)} with {scale_dtype}", blocks_name)
        if tuple(scale_shape) != tuple(shape[:-1]):
            raise refuse(source, f"the scales {scales_name} have shape {list(scale_shape)}, but {list(shape)} "
                                 f"blocks need {list(shape[:-1])}", blocks_name,
                         "the checkpoint is incomplete or damaged: download it again")
        scheme = Scheme("mxfp4", 4, None, "group", "U8", group_size=mxfp4.GROUP)
        found[name] = QuantizedTensor(name, blocks_name, scales_name, scheme, mxfp4.decoded_shape(tuple(shape)))
    for name in sorted(headers):
        if name.endswith("_scales") and name.removesuffix("_scales") not in found:
            raise refuse(source, "mxfp4 scales without their blocks (looked for "
                                 f"{name.removesuffix('_scales')}_blocks)", name,
                         "the checkpoint is incomplete: download it again")
    return found
