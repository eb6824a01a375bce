"""NVFP4 weights: E2M1 codes packed two a byte (even element in the low nibble) with one FP8 E4M3 scale per 16
input values and one float32 scale per tensor, as NVIDIA ModelOpt and compressed-tensors' ``nvfp4-pack-quantized``
store them (reference/kquants.md §7).

The two producers share the code bytes and the block-scale bytes; they differ in the tensor-wide scale, which
ModelOpt multiplies (``weight_scale_2 = amax / (6 · 448)``) and compressed-tensors divides by
(``weight_global_scale = 6 · 448 / amax``), in an all-zero block's scale (1.0 against 0.125) and in the code of a
negative value that rounds to zero (+0 against −0). :class:`Convention` names which; :func:`encode` writes what
that producer writes for the same float values, :func:`decode` reads either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Literal

from resumerge.inputs.quant.refusals import HeaderMap, refuse
from resumerge.inputs.quant.verdict import QuantizedTensor, Scheme
from resumerge.machine.torch_import import torch

__all__ = ["FP4_MAX", "FP8_MAX", "GROUP", "SUFFIXES", "Convention", "amax_of", "decode", "e2m1_codes", "encode",
           "nvfp4_weights"]

GROUP = 16  # input values per FP8 block scale
FP4_MAX = 6.0
FP8_MAX = 448.0
# "modelopt": the tensor-wide scale multiplies; "compressed-tensors": it divides.
Convention = Literal["modelopt", "compressed-tensors"]

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Magnitude thresholds between E2M1 neighbours; a tie goes to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
# 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), as both producers round.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_codes(scaled: torch.Tensor, *, negative_zero: bool) -> torch.Tensor:
    """The 4-bit E2M1 codes (uint8, bit 3 the sign) of float32 ``scaled`` rounded to nearest, ties to the even code,
    saturating at ±6; ``negative_zero`` gives a negative value that rounds to zero the sign bit (compressed-tensors'
    ``signbit``) rather than +0 (ModelOpt)."""
    magnitude = scaled.abs()
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=scaled.device)
    # bucketize(right=False) puts a value equal to a bound below it: the even side for bounds 0.25, 1.25, 2.5, 5.0;
    # the odd ties (0.75, 1.75, 3.5) go up, which their even neighbour is.
    index = torch.bucketize(magnitude, bounds, right=False)
    up = (magnitude == bounds[index.clamp(max=len(_BOUNDS) - 1)]) & torch.isin(
        index, torch.tensor((1, 3, 5), device=scaled.device))
    index = (index + up.to(index.dtype)).to(torch.uint8)
    negative = torch.signbit(scaled) if negative_zero else (scaled < 0) & (index > 0)
    return index | (negative.to(torch.uint8) << 3)


def decode(packed: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor, convention: Convention,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[rows, 2 · bytes]`` values of ``packed`` (uint8 ``[rows, bytes]``) with its E4M3 block ``scale``
    (``[rows, bytes / 8]``) and one-value ``tensor_scale``: code × (block scale × or ÷ tensor scale), the block's
    scale computed first in float32 as each producer dequantizes."""
    rows, width = packed.shape
    table = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, width * 2)
    value = table[codes.long()] if out is None else torch.index_select(table, 0, codes.reshape(-1).long(),
                                                                        out=out.view(-1)).view(rows, width * 2)
    block = scale.to(torch.float32)
    factor = tensor_scale.to(torch.float32).reshape(())
    block = block * factor if convention == "modelopt" else block / factor
    value.view(rows, -1, GROUP).mul_(block.unsqueeze(-1))
    return value if out is None else out


def amax_of(value: torch.Tensor) -> float:
    """The largest magnitude of ``value`` in float32, as :func:`encode` measures it (a Python float holds it
    exactly)."""
    return float(value.to(torch.float32).abs().amax())


def encode(value: torch.Tensor, convention: Convention,
           amax: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh NVFP4 parts of float ``value`` ``[rows, cols]`` (cols a multiple of 16): (packed codes uint8
    ``[rows, cols / 2]``, E4M3 block scales ``[rows, cols / 16]``, float32 tensor scale ``[1]``), as ``convention``'s
    producer computes them from the same float values (its amax, its zero-block scale, its rounding). ``amax``: the
    largest magnitude the tensor scale is computed from instead of ``value``'s own (:func:`amax_of`), the largest
    over a group of projections an inference engine fuses into one GEMM, which must share one tensor scale: both
    producers take the group's (compressed-tensors the smallest of its members' global scales, ModelOpt the largest
    of their amaxes), which is the same number."""
    w = value.to(torch.float32)
    rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"NVFP4 needs rows of whole {GROUP}-value blocks, not {cols}")
    groups = w.reshape(rows, cols // GROUP, GROUP)
    block_amax = groups.abs().amax(-1)
    measured = w.abs().amax() if amax is None else torch.tensor(amax, dtype=torch.float32, device=w.device)
    top = measured.clamp(min=torch.finfo(torch.float32).tiny)
    if convention == "compressed-tensors":
        # generate_gparam, calculate_qparams, _quantize: scale / global divides the value
        global_scale = torch.nan_to_num(FP8_MAX * FP4_MAX / top, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)
        local = (global_scale * (block_amax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        local = torch.where(local.to(torch.float32) == 0, torch.tensor(0.125, device=w.device),
                            local.to(torch.float32)).to(torch.float8_e4m3fn)
        effective = local.to(torch.float32) / global_scale
        tensor_scale = global_scale
    else:
        # ModelOpt's NVFP4QTensor: weight_scale_2 = amax / (6 · 448); a zero block's scale is 1
        tensor_scale = (top / (FP4_MAX * FP8_MAX)).reshape(1)
        local = (block_amax / (FP4_MAX * tensor_scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        local = torch.where(local.to(torch.float32) == 0, torch.tensor(1.0, device=w.device),
                            local.to(torch.float32)).to(torch.float8_e4m3fn)
        effective = local.to(torch.float32) * tensor_scale
    scaled = (groups / effective.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX).reshape(rows, cols)
    codes = e2m1_codes(scaled, negative_zero=convention == "compressed-tensors").reshape(rows, cols // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, local, tensor_scale.to(torch.float32)


# convention -> (the stored suffix of the codes, of the tensor-wide scale, of the static activation scale)
SUFFIXES: Mapping[str, tuple[str, str, str]] = MappingProxyType({
    "modelopt": (".weight", ".weight_scale_2", ".input_scale"),
    "compressed-tensors": (".weight_packed", ".weight_global_scale", ".input_global_scale"),
})
_INCOMPLETE = "the checkpoint is incomplete: download it again"


def nvfp4_weights(convention: Convention, modules: Iterable[str], headers: HeaderMap,
                  source: str) -> dict[str, QuantizedTensor]:
    """Every NVFP4 weight ``M.weight`` of ``modules`` (those storing a tensor-wide scale), by logical name: its
    codes, its block scale, and as extras its tensor-wide scale (first: it decodes the weight) and, when stored,
    its static activation scale (carried). Raises the one-line refusal for a part missing or of the wrong dtype
    or shape, naming the tensor."""
    codes_suffix, tensor_suffix, input_suffix = SUFFIXES[convention]
    found: dict[str, QuantizedTensor] = {}
    for module in sorted(modules):
        codes, scale = f"{module}{codes_suffix}", f"{module}.weight_scale"
        tensor, activation = f"{module}{tensor_suffix}", f"{module}{input_suffix}"
        for needed in (codes, scale):
            if needed not in headers:
                raise refuse(source, f"an NVFP4 weight without its parts (looked for {needed})", tensor, _INCOMPLETE)
        dtype, shape = headers[codes]
        scale_dtype, scale_shape = headers[scale]
        if dtype != "U8" or len(shape) != 2 or scale_dtype != "F8_E4M3" or (shape[1] * 2) % GROUP:
            raise refuse(source, f"NVFP4 codes are 2-D U8 with an F8_E4M3 scale per {GROUP} values, not {dtype} "
                                 f"{list(shape)} with {scale_dtype}", codes)
        if tuple(scale_shape) != (shape[0], shape[1] * 2 // GROUP):
            raise refuse(source, f"the NVFP4 scale {scale} has shape {list(scale_shape)}, but {list(shape)} codes "
                                 f"need {[shape[0], shape[1] * 2 // GROUP]}", codes,
                         "the checkpoint is incomplete or damaged: download it again")
        tensor_dtype, tensor_shape = headers[tensor]
        if tensor_dtype != "F32" or any(d != 1 for d in tensor_shape):
            raise refuse(source, f"an NVFP4 tensor-wide scale is one F32 value, not {tensor_dtype} "
                                 f"{list(tensor_shape)}", tensor)
        extras = (tensor, activation) if activation in headers else (tensor,)
        scheme = Scheme("nvfp4", 4, (1, GROUP), "tensor_group", "F8_E4M3", group_size=GROUP)
        found[f"{module}.weight"] = QuantizedTensor(f"{module}.weight", codes, scale, scheme,
                                                    (shape[0], shape[1] * 2), extras=extras)
    return found
