"""A checkpoint's quantization, from ``config.json``'s ``quantization_config`` and its safetensors headers alone.

:func:`recognise` decides per stored tensor from the companions in the headers — ``X_scale_inv`` beside an
F8_E4M3 ``X``, ``X_blocks`` beside ``X_scales``, compressed-tensors' ``weight_packed``/``weight_scale`` — and takes
from the config only how they decode (block size, bits, strategy): target and ignore lists do not reliably say which
tensors are quantized. The headers are the whole checkpoint's (every shard): a scale may sit in another shard than
its weight. Anything it cannot decode is refused with one line (:mod:`.refusals`): an unsupported format, an
unknown ``quant_method``, a quantized weight without its companion, a companion without its weight, a scale whose
shape does not match its weight's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from resumerge.inputs.quant import mxfp4
from resumerge.inputs.quant.grid import grid_shape
from resumerge.inputs.quant.recognise_ct import compressed_tensors_weights
from resumerge.inputs.quant.refusals import KNOWN, HeaderMap, refuse, refuse_method, telltale
from resumerge.inputs.quant.verdict import Checkpoint, QuantizedTensor, Scheme

__all__ = ["recognise"]

_SCALE_DTYPES = ("F32", "BF16", "F16")
# Endings only the companions of the formats decoded here have: found without a quantization_config, refused.
_COMPANION_MARKS = ("_scale_inv", ".weight_scale", ".weight_packed")


def recognise(quantization_config: Mapping[str, Any] | None, headers: HeaderMap, *, source: str = "") -> Checkpoint:
    """The verdict for one checkpoint: ``quantization_config`` (None or empty when config.json has none) and
    ``headers`` (every shard's tensors: name -> (safetensors dtype, shape)); ``source`` names the model in errors.

    Raises :class:`~resumerge.errors.ModelInputError` (exit 2), one line naming the format and a tensor, for
    anything it cannot decode.
    """
    if not quantization_config:
        _refuse_unconfigured(headers, source)
        return Checkpoint(None, {}, tuple(headers))
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "fp8":
        found = _fp8_weights(quantization_config, headers, source)
    elif method == "compressed-tensors":
        found = compressed_tensors_weights(quantization_config, headers, source)
    elif method == "mxfp4":
        found = _mxfp4_weights(headers, source)
    else:
        raise refuse_method(method or "(none)", headers, source)
    return Checkpoint(method if found else None, found, tuple(headers))


def _refuse_unconfigured(headers: HeaderMap, source: str) -> None:
    # One scan of every name for all the formats' telltales at once; each format's own only when one is there.
    every = tuple(f for _, _, fragments in KNOWN.values() for f in fragments)
    for _, tool, fragments in KNOWN.values() if telltale(headers, every) is not None else ():
        name = telltale(headers, fragments)
        if name is not None:
            # GPTQ, AWQ and AutoRound store the same names: name every format that could have written it.
            labels = " or ".join(dict.fromkeys(label for label, _, f in KNOWN.values() if telltale([name], f)))
            raise refuse(source, f"looks quantized with {labels} (config.json has no quantization_config), which "
                                 "resumerge cannot decode", name, f"dequantize it with its own tool first ({tool})")
    name = telltale(headers, _COMPANION_MARKS)
    name = name or min((n for n, (dtype, _) in headers.items() if n.endswith("_blocks") and dtype == "U8"),
                       default=None)
    if name is not None:
        raise refuse(source, "a quantization companion but no quantization_config in config.json, so resumerge "
                             "cannot tell how to decode it", name, "add the producer's quantization_config or "
                             "dequantize the checkpoint first")


def _fp8_weights(config: Mapping[str, Any], headers: HeaderMap, source: str) -> dict[str, QuantizedTensor]:
    fmt = str(config.get("fmt", "e4m3")).lower()
    scale_fmt = str(config.get("scale_fmt") or "float").lower()
    if fmt != "e4m3" or scale_fmt not in ("float", "ue8m0") or config.get("expert_dtype") not in (None, "fp8"):
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
    scales = sorted(n for n in headers if n.endswith("_scale_inv"))
    for scale_name in scales:
        name = scale_name.removesuffix("_scale_inv")
        weight = headers.get(name)
        if weight is None:
            raise refuse(source, "an fp8 scale without its weight (looked for "
                                 f"{name})", scale_name, "the checkpoint is incomplete: download it again")
        scale = headers[scale_name]
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
