"""The block-FP8 codec (DeepSeek-V3/R1, Kimi-K2, Qwen3 "-FP8"): ``X`` F8_E4M3 codes with ``X_scale_inv``, one
scale per block, over the kernels of :mod:`resumerge.inputs.quant.fp8_block`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.inputs.codecs.protocol import MAIN, Claim, OutPart, TensorCodec
from resumerge.inputs.codecs.quantized import SCALE, is_extra, quantized_claims
from resumerge.inputs.quant import fp8_block
from resumerge.inputs.quant.grid import grid_rows, grid_shape
from resumerge.inputs.quant.verdict import QuantizedTensor
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource


@dataclass(frozen=True)
class BlockFp8Codec(TensorCodec):
    """``quant_method: fp8``: value = code · scale of its ``block`` (edge blocks partial), in float32. ``fused``: a
    ``[experts, rows, cols]`` weight with ``[experts, grid rows, grid cols]`` scales (its rows are experts)."""

    name: ClassVar[str] = "fp8-block"
    claims: ClassVar[tuple[str, ...]] = ("fp8",)
    block: tuple[int, int]
    scale_fmt: str = "float"
    scale_dtype: str = "F32"
    fused: bool = False

    @classmethod
    def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
        """Every ``X`` with an ``X_scale_inv`` of a ``quant_method: fp8`` model."""
        return quantized_claims(config, tensors, ("fp8-block",), cls._codecs())

    @classmethod
    def recognise_among(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource],
                        shared: dict[object, Any]) -> tuple[Claim, ...]:
        return quantized_claims(config, tensors, ("fp8-block",), cls._codecs(), shared)

    @classmethod
    def of(cls, weight: QuantizedTensor) -> BlockFp8Codec:
        """The codec of one recognised block-FP8 weight."""
        assert weight.scheme.block is not None and weight.shape is not None  # recognise sets both for fp8
        return cls(weight.scheme.block, weight.scheme.scale_fmt, weight.scheme.scale_dtype, len(weight.shape) > 2)

    @classmethod
    def _codecs(cls) -> Callable[[QuantizedTensor], BlockFp8Codec]:
        """:meth:`of`, made once per block, scale format, scale dtype and rank (all it reads): 45k weights share a
        handful of codecs."""
        made: dict[tuple[object, ...], BlockFp8Codec] = {}

        def codec(weight: QuantizedTensor) -> BlockFp8Codec:
            scheme = weight.scheme
            key = (scheme.block, scheme.scale_fmt, scheme.scale_dtype, weight.shape is not None and len(weight.shape))
            return made.get(key) or made.setdefault(key, cls.of(weight))

        return codec

    @property
    def stored_as(self) -> str:
        return "FP8 codes"

    @property
    def row_block(self) -> int:
        return 1 if self.fused else self.block[0]

    def carries(self, part: str) -> bool:
        return is_extra(part)

    def part_rows(self, part: str, first: int, stop: int) -> tuple[int, int]:
        if is_extra(part):
            return 0, 1
        if part == SCALE and not self.fused:
            return grid_rows(first, stop, self.block)
        return first, stop

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_block.decode(parts[MAIN], parts[SCALE], self.block, row_start=0 if self.fused else first_row,
                                out=out)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        grid = (*shape[:-2], *grid_shape((shape[-2], shape[-1]), self.block))
        return OutPart(MAIN, name, "F8_E4M3", shape), OutPart(SCALE, f"{name}_scale_inv", self.scale_dtype, grid)

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """Fresh scales (amax / 448 per block) and codes; the value must start at a block row."""
        values = value.to(torch.float32).contiguous()  # only read by the kernel: no copy of a float32 result
        scale_dtype = TORCH_DTYPES[self.scale_dtype]
        if values.ndim == 2:
            codes, scale = fp8_block.encode(values, self.block, scale_fmt=self.scale_fmt, scale_dtype=scale_dtype)
            return {MAIN: codes, SCALE: scale}
        flat = values.reshape(-1, *values.shape[-2:])
        # Each expert's codes written in place.
        codes = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=flat.device)
        scales = torch.stack([fp8_block.encode(m, self.block, scale_fmt=self.scale_fmt, scale_dtype=scale_dtype,
                                               codes_out=codes[index])[1] for index, m in enumerate(flat)])
        return {MAIN: codes.reshape(values.shape), SCALE: scales.reshape(*values.shape[:-2], *scales.shape[-2:])}
