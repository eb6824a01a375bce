"""The NVFP4 codec: E2M1 codes two a byte with an FP8 E4M3 scale per 16 input values and a float32 scale per tensor,
as NVIDIA ModelOpt stores them (``quant_method: modelopt``, ``quant_algo: NVFP4``: ``weight``, ``weight_scale``,
``weight_scale_2``) and as compressed-tensors' ``nvfp4-pack-quantized`` does (``weight_packed``, ``weight_scale``,
``weight_global_scale``, recognised by :mod:`resumerge.inputs.quant.recognise_ct`); over the kernels of
:mod:`resumerge.inputs.quant.nvfp4`. An output whose base is NVFP4 is encoded again with fresh scales, as its
producer computes them, each fused group of projections (q/k/v, gate/up: :mod:`resumerge.merge.plan.fusedscales`) with
one tensor-wide scale."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.inputs.codecs.protocol import MAIN, OutPart, SharedScale, TensorEncoder
from resumerge.inputs.codecs.quantized import SCALE, QuantizedCodec, extra_part, is_extra
from resumerge.inputs.quant import nvfp4
from resumerge.inputs.quant.refusals import HeaderMap, refuse, telltale
from resumerge.inputs.quant.verdict import QuantizedTensor
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.inputs.files import TensorSource

# A row block no tensor reaches: the tensor-wide scale is the whole tensor's amax, so a tensor is encoded whole.
_WHOLE = 1 << 62
# ModelOpt's quant_algo values that are not plain NVFP4 weights, each refused by name.
_OTHER_ALGOS = MappingProxyType({
    "NVFP4_AWQ": "NVFP4 with AWQ pre-quantization scales (pre_quant_scale)",
    "W4A8_NVFP4_FP8": "W4A8 (NVFP4 weights with FP8 activations, weight_scale_2 = amax/448)",
    "W4A8_AWQ": "W4A8 AWQ", "W4A16_AWQ": "W4A16 AWQ", "W4A8_MXFP4_FP8": "W4A8 MXFP4",
    "FP8": "FP8 (per-tensor)", "FP8_PB_WO": "block FP8", "FP8_PER_CHANNEL_PER_TOKEN": "FP8 per channel",
    "INT8_SQ": "INT8 SmoothQuant", "INT4_AWQ": "INT4 AWQ", "MXFP8": "MXFP8", "NVFP4_SVDQUANT": "NVFP4 SVDQuant",
})
_PRODUCER = "export it unquantized with TensorRT Model Optimizer and merge that copy"


@dataclass(frozen=True)
class Nvfp4Codec(QuantizedCodec, SharedScale):
    """``quant_method: modelopt`` (``quant_algo: NVFP4``), and compressed-tensors' ``nvfp4-pack-quantized``: value =
    E2M1 code × block scale × (or ÷) tensor scale, float32 ``[rows, 2 · bytes]``.

    ``convention``: ``modelopt`` (the tensor scale ``weight_scale_2`` multiplies, a scalar) or
    ``compressed-tensors`` (``weight_global_scale`` divides, shape [1]); ``tensor_shape``: that scale's stored
    shape, so an encoded tensor is stored the same way. ``group``: the output tensors an inference engine fuses
    with this one into one GEMM, which share its tensor scale (() alone; a plan's decision, fingerprinted);
    ``amax``: the group's largest magnitude, which the engine gives a member's codec before encoding it (never in
    a plan)."""

    name: ClassVar[str] = "nvfp4"
    claims: ClassVar[tuple[str, ...]] = ("modelopt",)
    convention: str = "modelopt"
    tensor_shape: tuple[int, ...] = ()
    group: tuple[str, ...] = ()
    amax: float | None = None

    def identity(self) -> tuple[Any, ...]:
        """The format and its parameters, the group only when there is one (an ungrouped tensor's plan keeps the
        fingerprint it had before groups existed); never ``amax``, which no plan holds."""
        found = (self.name, self.convention, self.tensor_shape)
        return (*found, self.group) if self.group else found

    def grouped(self, group: tuple[str, ...]) -> TensorEncoder:
        return replace(self, group=tuple(group), amax=None)

    def amax_of(self, value: torch.Tensor) -> float:
        return nvfp4.amax_of(value)

    def scaled(self, amax: float) -> TensorEncoder:
        return replace(self, amax=amax)

    @classmethod
    def weights(cls, quantization: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
        """Every ``M.weight`` with ``M.weight_scale_2`` of a ``quant_method: modelopt`` NVFP4 model; any other
        ModelOpt algorithm (NVFP4_AWQ, W4A8, FP8...) is refused by name, as is an FP8 KV cache."""
        algos = _algorithms(quantization)
        for algo in algos:
            if algo != "NVFP4":
                what = _OTHER_ALGOS.get(algo, algo if algo.startswith("config") else f"quant_algo {algo!r}")
                raise refuse(source, f"quantized with NVIDIA ModelOpt {what}, which resumerge cannot decode (it "
                                     "decodes NVFP4)", telltale(headers, (".pre_quant_scale", ".weight_scale"))
                             or min(headers, default=None), f"{_PRODUCER}")
        awq = telltale(headers, (".pre_quant_scale",))
        if awq is not None:
            raise refuse(source, "NVFP4 with AWQ pre-quantization scales (NVFP4_AWQ), which resumerge cannot "
                                 "decode", awq, _PRODUCER)
        if quantization.get("kv_cache_quant_algo") or telltale(headers, (".k_scale", ".v_scale")):
            raise refuse(source, "NVIDIA ModelOpt KV-cache scales, which resumerge cannot merge",
                         telltale(headers, (".k_scale", ".v_scale")) or min(headers, default=None),
                         "export the checkpoint without a quantized KV cache (kv_cache_quant_algo: null)")
        modules = {n.removesuffix(".weight_scale_2") for n in headers if n.endswith(".weight_scale_2")}
        found = nvfp4.nvfp4_weights("modelopt", modules, headers, source)
        claimed = {n for w in found.values() for n in w.stored()}
        for name in sorted(headers):
            if name.endswith((".weight_scale", ".input_scale")) and name not in claimed:
                raise refuse(source, "a ModelOpt scale without its NVFP4 weight", name,
                             "the checkpoint is incomplete: download it again")
        return found

    @classmethod
    def codec_of(cls, tensors: Mapping[str, TensorSource]) -> Callable[[QuantizedTensor], Nvfp4Codec]:
        return lambda weight: cls.of(weight, tensors)

    @classmethod
    def of(cls, weight: QuantizedTensor, tensors: Mapping[str, TensorSource]) -> Nvfp4Codec:
        """The codec of one recognised NVFP4 weight of either producer (its tensor scale is its first extra)."""
        tensor = weight.extras[0]
        convention = "compressed-tensors" if tensor.endswith(nvfp4.SUFFIXES["compressed-tensors"][1]) else "modelopt"
        return cls(convention, tuple(tensors[tensor].entry.shape))

    @property
    def _suffixes(self) -> tuple[str, str, str]:
        return nvfp4.SUFFIXES[self.convention]

    @property
    def _tensor_part(self) -> str:
        return self._suffixes[1].lstrip(".")

    @property
    def stored_as(self) -> str:
        return "packed NVFP4 bytes"

    def value_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (stored[0], stored[1] * 2)

    @property
    def row_block(self) -> int:
        return _WHOLE

    def carries(self, part: str) -> bool:
        return is_extra(part) and part != self._tensor_part

    def part_rows(self, part: str, first: int, stop: int) -> tuple[int, int]:
        return (0, 1) if is_extra(part) else (first, stop)

    def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return nvfp4.decode(parts[MAIN].view(torch.uint8), parts[SCALE], parts[self._tensor_part],
                            "modelopt" if self.convention == "modelopt" else "compressed-tensors", out=out)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        module = name.removesuffix(".weight")
        rows, cols = shape
        codes, tensor, _ = self._suffixes
        return (OutPart(MAIN, f"{module}{codes}", "U8", (rows, cols // 2)),
                OutPart(SCALE, f"{module}.weight_scale", "F8_E4M3", (rows, cols // nvfp4.GROUP)),
                OutPart(extra_part(name, f"{module}{tensor}"), f"{module}{tensor}", "F32", self.tensor_shape))

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """Fresh block and tensor scales and E2M1 codes, as the producer of this convention computes them (the
        input width must be a multiple of 16), the tensor scale from the group's ``amax`` when it is given."""
        packed, scale, tensor = nvfp4.encode(value, "modelopt" if self.convention == "modelopt"
                                             else "compressed-tensors", self.amax)
        return {MAIN: packed, SCALE: scale, self._tensor_part: tensor.reshape(self.tensor_shape)}


def _algorithms(quantization: Mapping[str, Any]) -> tuple[str, ...]:
    """The ModelOpt quantization algorithms a ``quant_method: modelopt`` config names: its ``quant_algo``, or, for
    ``MIXED_PRECISION``, each quantized layer's; NVFP4 when it names none but its config groups are 4-bit float
    weights in groups of 16 (``weights: {num_bits: 4, type: float, group_size: 16}``)."""
    algo = str(quantization.get("quant_algo") or "").upper()
    if algo == "MIXED_PRECISION":
        layers = quantization.get("quantized_layers") or {}
        return tuple(sorted({str(v.get("quant_algo", "")).upper() for v in layers.values()
                             if isinstance(v, Mapping)})) or ("MIXED_PRECISION",)
    if algo:
        return (algo,)
    for group in (quantization.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping) and not (weights.get("num_bits") == 4 and weights.get("type") == "float"
                                                 and weights.get("group_size") == nvfp4.GROUP):
            return (f"config group weights {dict(weights)}",)
    return ("NVFP4",)
