"""The MXFP4 codec (gpt-oss experts): ``X_blocks`` (two E2M1 codes per byte) with ``X_scales`` (one power of two
per 32 input values), decoded to transformers' ``[experts, in, out]`` layout by :mod:`resumerge.inputs.quant.mxfp4`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.protocol import MAIN, Claim, OutPart, TensorCodec
from resumerge.inputs.codecs.quantized import SCALE, quantized_claims
from resumerge.inputs.quant import mxfp4
from resumerge.inputs.quant.verdict import QuantizedTensor
from resumerge.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource


@dataclass(frozen=True)
class Mxfp4Codec(TensorCodec):
    """``quant_method: mxfp4``: ``X`` is ``X_blocks`` ``[experts, out, G, 16]`` with ``X_scales`` ``[experts, out,
    G]``, valued ``[experts, G · 32, out]`` in float32. Its rows are experts, whole in every part."""

    name: ClassVar[str] = "mxfp4"
    claims: ClassVar[tuple[str, ...]] = ("mxfp4",)

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        """Every ``X_blocks`` with its ``X_scales`` of a ``quant_method: mxfp4`` model."""
        return quantized_claims(config, tensors, ("mxfp4",), cls.of)

    @classmethod
    def recognise_among(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource],
                        shared: dict[object, Any]) -> tuple[Claim, ...]:
        return quantized_claims(config, tensors, ("mxfp4",), cls.of, shared)

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
