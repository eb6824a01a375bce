"""The block-FP8 codec (DeepSeek-V3/R1, Kimi-K2, Qwen3 "-FP8"): ``X`` F8_E4M3 codes with ``X_scale_inv``, one
scale per block, over the kernels of :mod:`resumerge.inputs.quant.fp8_block`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.inputs.codecs.fp4 import FP4, Fp4Codec, dotted_scale
from resumerge.inputs.codecs.protocol import MAIN, OutPart, TensorCodec
from resumerge.inputs.codecs.quantized import SCALE, QuantizedCodec, is_extra
from resumerge.inputs.quant import fp8_block
from resumerge.inputs.quant.grid import grid_rows, grid_shape
from resumerge.inputs.quant.refusals import HeaderMap, refuse
from resumerge.inputs.quant.verdict import QuantizedTensor, Scheme
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource


@dataclass(frozen=True)
class BlockFp8Codec(QuantizedCodec):
    """``quant_method: fp8``: value = code · scale of its ``block`` (edge blocks partial), in float32. ``fused``: a
    ``[experts, rows, cols]`` weight with ``[experts, grid rows, grid cols]`` scales (its rows are experts)."""

    name: ClassVar[str] = "fp8-block"
    claims: ClassVar[tuple[str, ...]] = ("fp8",)
    block: tuple[int, int]
    scale_fmt: str = "float"
    scale_dtype: str = "F32"
    fused: bool = False

    @classmethod
    def weights(cls, quantization: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
        """Every ``X`` with an ``X_scale_inv`` of a ``quant_method: fp8`` model."""
        return _fp8_weights(quantization, headers, source)

    @classmethod
    def codec_of(cls, tensors: Mapping[str, TensorSource]) -> Callable[[QuantizedTensor], TensorCodec]:
        """The codec of each weight: block FP8 (its scale ``X_scale_inv``, or DeepSeek-V4's ``X.scale``), or
        DeepSeek-V4's FP4 experts (:mod:`.fp4`)."""
        codecs = cls._codecs()
        fp4s: dict[str, Fp4Codec] = {}

        def codec(weight: QuantizedTensor) -> TensorCodec:
            if weight.scheme.kind == FP4:
                dtype = weight.scheme.scale_dtype
                return fp4s.get(dtype) or fp4s.setdefault(dtype, Fp4Codec(dtype))
            made = codecs(weight)
            return DottedFp8Codec(*astuple(made)) if weight.scale == dotted_scale(weight.name) else made

        return codec

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


@dataclass(frozen=True)
class DottedFp8Codec(BlockFp8Codec):
    """Block FP8 whose scale is ``X.scale`` beside ``X.weight`` (DeepSeek-V4's naming) rather than
    ``X.weight_scale_inv``."""

    name: ClassVar[str] = "fp8-block-dotted"

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        main, scale = super().out_parts(name, dtype, shape)
        return main, OutPart(SCALE, dotted_scale(name), scale.dtype, scale.shape)


_SCALE_DTYPES = ("F32", "BF16", "F16")


def _fp8_weights(config: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
    fmt = str(config.get("fmt", "e4m3")).lower()
    scale_fmt = str(config.get("scale_fmt") or "float").lower()
    if fmt != "e4m3" or scale_fmt not in ("float", "ue8m0") or config.get("expert_dtype") not in (None, "fp8", "fp4"):
        detail = f"fmt {fmt}, scale_fmt {scale_fmt}, expert_dtype {config.get('expert_dtype')}"
        raise refuse(source, f"an fp8 quantization resumerge cannot decode ({detail})", min(headers, default=None))
    size = config.get("weight_block_size")
    found: dict[str, QuantizedTensor] = {}
    # (weight's header, scale's header) -> its scheme, checked once: 45k weights share a handful of shapes, and one
    # scheme per block and scale dtype serves them all.
    checked: dict[tuple[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]], Scheme] = {}
    schemes: dict[tuple[tuple[int, int], str], Scheme] = {}
    inputs = {n for n in headers if n.endswith(".input_scale")}
    carried: set[str] = set()  # the activation scales the weights carry
    # DeepSeek-V4 names a weight's scale X.scale beside X.weight (an FP8 one's, and its FP4 experts')
    dotted = {dotted_scale(n): n for n, (dtype, _) in headers.items()
              if n.endswith(".weight") and dtype in ("F8_E4M3", "I8") and dotted_scale(n) in headers}
    scales = sorted(n for n in headers if n.endswith("_scale_inv")) + sorted(dotted)
    for scale_name in scales:
        name = dotted.get(scale_name) or scale_name.removesuffix("_scale_inv")
        weight = headers.get(name)
        if weight is None:
            raise refuse(source, "an fp8 scale without its weight (looked for "
                                 f"{name})", scale_name, "the checkpoint is incomplete: download it again")
        scale = headers[scale_name]
        if weight[0] == "I8":
            found[name] = _fp4_weight(name, weight, scale, scale_name, source)
            continue
        scheme = checked.get((weight, scale))
        if scheme is None:
            block = _fp8_block(weight, scale, size, scale_name, source)
            scheme = schemes.get((block, scale[0])) or schemes.setdefault(
                (block, scale[0]), Scheme("fp8-block", 8, block, "block", scale[0], scale_fmt=scale_fmt))
            checked[(weight, scale)] = scheme
        extra = f"{name.removesuffix('.weight')}.input_scale" if inputs and name.endswith(".weight") else None
        extras = (extra,) if extra in inputs else ()
        found[name] = QuantizedTensor(name, name, scale_name, scheme, tuple(weight[1]), extras=extras)
        if extras:
            carried.update(extras)
    # What the weights claim: their codes (the keys of found), scales and carried activation scales.
    unclaimed = {n for n, (dtype, _) in headers.items() if dtype == "F8_E4M3" and n not in found and n not in carried}
    unclaimed |= inputs - carried - found.keys()
    if unclaimed:
        unclaimed -= set(scales)
    # The first (sorted) of them is refused, as a weight without its scale when it is one.
    stray = min((n for n in unclaimed if headers[n][0] == "F8_E4M3"), default=None)
    stray_input = min((n for n in unclaimed if n in inputs), default=None)
    if stray is not None and (stray_input is None or stray <= stray_input):
        raise refuse(source, f"an fp8 weight without its scale (looked for {stray}_scale_inv)", stray,
                     "the checkpoint is incomplete: download it again")
    if stray_input is not None:
        raise refuse(source, "an activation scale without a quantized weight", stray_input)
    return found


def _fp4_weight(name: str, weight: tuple[str, tuple[int, ...]], scale: tuple[str, tuple[int, ...]], scale_name: str,
                source: str) -> QuantizedTensor:
    """DeepSeek-V4's FP4 expert ``name`` (header ``weight``) with its scale ``scale_name`` (header ``scale``):
    refused unless I8 ``[..., rows, cols / 2]`` with an F8_E8M0 (or U8) ``[..., rows, cols / 32]`` scale."""
    (_, shape), (scale_dtype, scale_shape) = weight, scale
    if scale_dtype not in ("F8_E8M0", "U8") or len(shape) < 2 or shape[-1] % 16:
        raise refuse(source, f"an fp4 weight must be I8 [..., rows, cols / 2] (cols a multiple of 32) with an "
                             f"F8_E8M0 scale, not {list(shape)} with {scale_dtype}", name)
    expected = (*shape[:-1], shape[-1] // 16)
    if tuple(scale_shape) != expected:
        raise refuse(source, f"the scale {scale_name} has shape {list(scale_shape)}, but a {list(shape)} fp4 weight "
                             f"(one scale per 32 values) needs {list(expected)}", name,
                     "the checkpoint is incomplete or damaged: download it again")
    scheme = Scheme(FP4, 4, None, "group", scale_dtype, group_size=32, scale_fmt="ue8m0")
    return QuantizedTensor(name, name, scale_name, scheme, (*shape[:-1], shape[-1] * 2))


def _fp8_block(weight: tuple[str, tuple[int, ...]], scale: tuple[str, tuple[int, ...]],
               size: Any, scale_name: str, source: str) -> tuple[int, int]:
    """The block of the fp8 weight whose header is ``weight`` with the scale ``scale_name`` (header ``scale``):
    ``size`` (the config's ``weight_block_size``), or the whole weight without one. Raises the refusal for a
    weight that is not F8_E4M3 of two or more dimensions with a float scale, or whose scale's shape is not its
    grid's."""
    (dtype, shape), (scale_dtype, scale_shape) = weight, scale
    name = scale_name.removesuffix("_scale_inv")
    if dtype != "F8_E4M3" or scale_dtype not in (*_SCALE_DTYPES, "F8_E8M0") or len(shape) < 2:
        raise refuse(source, f"an fp8 weight must be a 2-D or fused F8_E4M3 tensor with a float scale, not "
                             f"{dtype} {list(shape)} with {scale_dtype}", name)
    block = (int(size[0]), int(size[1])) if size else (shape[-2], shape[-1])
    expected = (*shape[:-2], *grid_shape((shape[-2], shape[-1]), block))
    if tuple(scale_shape) != expected and not (not size and math.prod(scale_shape) == 1):
        raise refuse(source, f"the scale {scale_name} has shape {list(scale_shape)}, but a {list(shape)} weight "
                             f"in {list(block)} blocks needs {list(expected)}", name,
                     "the checkpoint or its weight_block_size is wrong: download it again")
    return block
