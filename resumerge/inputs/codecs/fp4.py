"""DeepSeek-V4's FP4 experts (``quant_method: fp8`` with ``expert_dtype: fp4``): ``X.weight`` I8 ``[rows, cols / 2]``,
two E2M1 codes a byte (the even input in the low nibble), with ``X.scale`` F8_E8M0 ``[rows, cols / 32]``, one power
of two per 32 inputs of a row (transformers' ``FP8Experts`` with ``expert_dtype="fp4"``: ``weight_k_div`` 2,
``sf_gran_k`` 32). The codes and scales are MXFP4's (:mod:`resumerge.inputs.quant.mxfp4`), laid out
``[rows, cols]`` as a linear layer's weight rather than gpt-oss's transposed stacks; the block-FP8 codec
(:mod:`.fp8_block`) recognises these weights beside its own, and DeepSeek-V4's ``X.scale`` naming of both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.inputs.codecs.protocol import MAIN, Claim, OutPart, TensorCodec
from resumerge.inputs.codecs.quantized import SCALE
from resumerge.inputs.quant import mxfp4
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource

FP4 = "fp4-e2m1"


def dotted_scale(name: str) -> str:
    """DeepSeek-V4's name of weight ``name``'s scale: ``X.scale`` beside ``X.weight``."""
    return name.removesuffix("weight") + "scale"


@dataclass(frozen=True)
class Fp4Codec(TensorCodec):
    """``X.weight`` I8 ``[rows, cols / 2]`` with ``X.scale`` ``[rows, cols / 32]`` (``scale_dtype``: F8_E8M0 as
    shipped, or U8), valued ``[rows, cols]`` in float32; its rows are independent."""

    name: ClassVar[str] = FP4
    scale_dtype: str = "F8_E8M0"

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        return ()  # the block-FP8 codec recognises these weights: their checkpoint's quant_method is its fp8

    @property
    def stored_as(self) -> str:
        return "packed FP4 bytes"

    def value_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (*stored[:-1], stored[-1] * 2)

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = parts[MAIN], parts[SCALE]
        rows, width = codes.shape[-2:]
        blocks = codes.contiguous().view(torch.uint8).reshape(-1, rows, width // 16, 16)
        found = mxfp4.decode(blocks, scales.contiguous().view(torch.uint8).reshape(-1, rows, width // 16))
        value = found.transpose(-1, -2).reshape(*codes.shape[:-1], width * 2)
        if out is None:
            return value.contiguous()
        return out.copy_(value)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        *lead, cols = shape
        return (OutPart(MAIN, name, "I8", (*lead, cols // 2)),
                OutPart(SCALE, dotted_scale(name), self.scale_dtype, (*lead, cols // mxfp4.GROUP)))

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """Fresh power-of-two scales and E2M1 codes (the input width must be a multiple of 32)."""
        *lead, rows, cols = value.shape
        blocks, scales = mxfp4.encode(value.to(torch.float32).reshape(-1, rows, cols).transpose(-1, -2))
        return {MAIN: blocks.view(torch.int8).reshape(*lead, rows, cols // 2),
                SCALE: scales.reshape(*lead, rows, cols // mxfp4.GROUP).view(TORCH_DTYPES[self.scale_dtype])}
