"""The compressed-tensors codec (llm-compressor): pack-quantized INT2/4/8 (``weight_packed`` I32 words with
``weight_shape``), naive-/int-quantized I8 and float-quantized F8_E4M3 ``weight``, each with ``weight_scale``
(per tensor, channel, group or block) and, when asymmetric, ``weight_zero_point``; over the kernels of
:mod:`resumerge.inputs.quant.compressed_tensors`. Its ``nvfp4-pack-quantized`` weights are decoded and encoded by
:class:`~resumerge.inputs.codecs.nvfp4.Nvfp4Codec`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.nvfp4 import Nvfp4Codec
from resumerge.inputs.codecs.protocol import MAIN, OutPart, TensorDecoder
from resumerge.inputs.codecs.quantized import SCALE, SHAPE, ZERO_POINT, QuantizedCodec, is_extra
from resumerge.inputs.quant import compressed_tensors as ct
from resumerge.inputs.quant.grid import grid_rows, grid_shape
from resumerge.inputs.quant.int_pack import packed_cols
from resumerge.inputs.quant.recognise_ct import compressed_tensors_weights
from resumerge.inputs.quant.refusals import HeaderMap
from resumerge.inputs.quant.verdict import Kind, QuantizedTensor
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource

# A row block no tensor reaches: every row chunk is the whole tensor.
_WHOLE = 1 << 62
_KINDS: tuple[Kind, ...] = ("ct-packed", "ct-naive", "ct-float")
_CODE_DTYPES = MappingProxyType({"ct-packed": "I32", "ct-naive": "I8", "ct-float": "F8_E4M3"})


@dataclass(frozen=True)
class CompressedTensorsCodec(QuantizedCodec):
    """``quant_method: compressed-tensors``: value = (code − zero point) · scale of its ``block``, in float32.

    ``kind``: ``ct-packed``, ``ct-naive`` or ``ct-float``; ``cols``: the value's width (a packed row holds up to a
    word more); ``scale_shape`` and ``zero_point_dtype``: as stored, so an encoded tensor is stored the same way.
    """

    name: ClassVar[str] = "compressed-tensors"
    claims: ClassVar[tuple[str, ...]] = ("compressed-tensors",)
    kind: str
    bits: int
    block: tuple[int, int]
    cols: int
    scale_dtype: str
    scale_shape: tuple[int, ...]
    zero_point_dtype: str | None = None

    @classmethod
    def weights(cls, quantization: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
        """Every module ``M`` with ``M.weight_scale`` of a ``quant_method: compressed-tensors`` model
        (:mod:`resumerge.inputs.quant.recognise_ct`, this format's own reading of its config)."""
        return compressed_tensors_weights(quantization, headers, source)

    @classmethod
    def codec_of(cls, tensors: Mapping[str, TensorSource]) -> Callable[[QuantizedTensor], TensorDecoder]:
        # An nvfp4-pack-quantized weight is NVFP4's codec (the E2M1 kernels and their global scale).
        return lambda weight: Nvfp4Codec.of(weight, tensors) if weight.scheme.kind == "nvfp4" else cls.of(weight,
                                                                                                           tensors)

    @classmethod
    def of(cls, weight: QuantizedTensor, tensors: Mapping[str, TensorSource]) -> CompressedTensorsCodec:
        """The codec of one recognised weight. A packed per-tensor or per-channel weight's exact width is only in
        ``weight_shape``'s payload: it is taken as the words' whole width, and :meth:`decode` checks it."""
        scheme = weight.scheme
        codes = tensors[weight.codes].entry.shape
        cols = weight.shape[1] if weight.shape is not None else codes[1] * (32 // scheme.bits)
        rows = codes[0]
        # The recognised block may be wider than the weight (tensor, channel): the stored grid is one column.
        block = ct.strategy_block(scheme.strategy, (rows, cols), group_size=scheme.group_size,
                                  block_structure=scheme.block) if scheme.strategy != "block" else scheme.block
        assert block is not None
        zero_point = tensors[weight.zero_point].entry.dtype if weight.zero_point is not None else None
        return cls(scheme.kind, scheme.bits, block, cols, scheme.scale_dtype,
                   tuple(tensors[weight.scale].entry.shape), zero_point)

    @property
    def _packed(self) -> bool:
        return self.kind == "ct-packed"

    @property
    def stored_as(self) -> str:
        return {"ct-packed": f"packed INT{self.bits} words", "ct-naive": f"INT{self.bits} codes"}.get(self.kind,
                                                                                                   "FP8 codes")

    def value_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (stored[0], self.cols)

    @property
    def row_block(self) -> int:
        # A packed weight's weight_shape names the whole tensor's rows, and its zero points pack several rows per
        # word: it is encoded whole (a block taller than any tensor). A per-tensor scale's block is the tensor.
        return _WHOLE if self._packed else self.block[0]

    def carries(self, part: str) -> bool:
        return is_extra(part)

    def part_rows(self, part: str, first: int, stop: int) -> tuple[int, int]:
        if is_extra(part):
            return 0, 1
        if part == SHAPE:
            return 0, 2
        if part == ZERO_POINT and self._packed and self.block[0] == 1:
            per = 32 // self.bits  # packed along the rows: a word row holds `per` rows' zero points
            return first // per, -(-stop // per)
        return grid_rows(first, stop, self.block)

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        zero_point = parts.get(ZERO_POINT)
        if not self._packed:
            return ct.decode_naive(parts[MAIN], parts[SCALE], self.block, zero_point=zero_point, row_start=first_row,
                                   out=out)
        stored = [int(v) for v in parts[SHAPE].tolist()]
        if len(stored) != 2 or stored[1] != self.cols:
            raise ModelInputError(f"weight_shape says {stored}, but its packed words and scale were read as "
                                  f"{self.cols} columns", hint="the checkpoint is damaged: download it again")
        if zero_point is not None and self.block[0] == 1:  # packed along rows per group or channel; else as stored
            per = 32 // self.bits
            skip = first_row - (first_row // per) * per
            unpacked = ct.unpack_zero_point(zero_point, self.bits, zero_point.shape[0] * per)
            zero_point = unpacked[skip : skip + parts[MAIN].shape[0]]
        return ct.decode_packed(parts[MAIN], parts[SCALE], self.block, bits=self.bits, cols=self.cols,
                                zero_point=zero_point, row_start=first_row, out=out)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        module = name.removesuffix("weight")
        rows, cols = shape
        grid = grid_shape((rows, cols), self.block)
        scale = self.scale_shape if self.block == (rows, cols) or self.block[0] > rows else grid
        main = OutPart(MAIN, f"{module}weight_packed", "I32", (rows, packed_cols(cols, self.bits))) if self._packed \
            else OutPart(MAIN, name, _CODE_DTYPES[self.kind], shape)
        out = [main, OutPart(SCALE, f"{module}weight_scale", self.scale_dtype, scale)]
        if self.zero_point_dtype is not None:
            zero_shape = (-(-rows * self.bits // 32), grid[1]) if self._packed and self.block[0] == 1 else scale
            out.append(OutPart(ZERO_POINT, f"{module}weight_zero_point", self.zero_point_dtype, zero_shape))
        if self._packed:
            out.append(OutPart(SHAPE, f"{module}weight_shape", "I64", (2,)))
        return tuple(out)

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """Fresh scales (and zero points), as compressed-tensors computes them; the value starts at a block row."""
        values = value.to(torch.float32, copy=True)
        codes, scale, zero_point = ct.quantize(
            values, self.block, bits=self.bits, kind="float" if self.kind == "ct-float" else "int",
            symmetric=self.zero_point_dtype is None, scale_dtype=TORCH_DTYPES[self.scale_dtype], packed=self._packed)
        rows, cols = value.shape
        whole = self.block == (rows, cols) or self.block[0] > rows
        parts = {MAIN: codes, SCALE: scale.reshape(self.scale_shape) if whole else scale}
        if zero_point is not None:
            assert self.zero_point_dtype is not None
            if self._packed and self.block[0] == 1:
                zero_point = ct.pack_zero_point(zero_point, self.bits)
            parts[ZERO_POINT] = zero_point.to(TORCH_DTYPES[self.zero_point_dtype])
        if self._packed:
            parts[SHAPE] = torch.tensor([rows, cols], dtype=torch.int64, device=value.device)
        return parts
