"""compressed-tensors checkpoints: which weights are quantized (from the companions in the headers) and how each
decodes (from the one ``config_groups`` entry whose ``weights`` fit its stored tensors).

A module ``M`` is quantized when ``M.weight_scale`` is stored, with ``M.weight_packed`` (I32, plus
``M.weight_shape``) for pack-quantized or ``M.weight`` (I8 or F8_E4M3) otherwise; ``M.weight_zero_point`` makes it
asymmetric. When several groups fit a weight's dtypes and scale shape, the group whose ``targets`` name the module
(exactly or by a ``re:`` pattern, anchored at the start as compressed-tensors' ``re.match``) decides; class-name
targets (``Linear``) cannot be resolved from a state dict, so an ambiguity left after that is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from resumerge.inputs.quant.compressed_tensors import STRATEGIES
from resumerge.inputs.quant.grid import grid_shape
from resumerge.inputs.quant.int_pack import PACKABLE_BITS, packed_cols
from resumerge.inputs.quant.nvfp4 import GROUP as NVFP4_GROUP
from resumerge.inputs.quant.nvfp4 import nvfp4_weights
from resumerge.inputs.quant.refusals import HeaderMap, refuse, telltale
from resumerge.inputs.quant.verdict import Kind, QuantizedTensor, Scheme

__all__ = ["compressed_tensors_weights", "packed_shape"]

# format -> the kind of weight it stores.
_FORMATS: Mapping[str, Kind] = MappingProxyType({
    "pack-quantized": "ct-packed", "naive-quantized": "ct-naive", "int-quantized": "ct-naive",
    "float-quantized": "ct-float"})
_PLAIN_KINDS: Mapping[str, Kind] = MappingProxyType({"I8": "ct-naive", "F8_E4M3": "ct-float"})
# Companions of formats not decoded here (NVFP4's global scales outside an nvfp4-pack-quantized checkpoint,
# ModelOpt's scale 2, activation-ordered groups' permutation).
_REFUSED = MappingProxyType({
    ".weight_global_scale": "NVFP4 global scales", ".input_global_scale": "NVFP4 global scales",
    ".weight_scale_2": "NVFP4 second-level scales", ".weight_g_idx": "activation-ordered groups (g_idx)"})
# Companions carried with a quantized weight but not used to decode it.
_EXTRAS = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point")
_COMPANIONS = (".weight_scale", ".weight_zero_point", ".weight_shape", *_EXTRAS)
_NVFP4 = "nvfp4-pack-quantized"
_SCALE_DTYPES = ("F32", "BF16", "F16")
_INCOMPLETE = "the checkpoint is incomplete: download it again"


def compressed_tensors_weights(config: Mapping[str, Any], headers: HeaderMap,
                               source: str) -> dict[str, QuantizedTensor]:
    """Every quantized weight of a compressed-tensors checkpoint, by logical name (``M.weight``)."""
    status = config.get("quantization_status") or "compressed"
    if status != "compressed":
        raise refuse(source, f"a compressed-tensors checkpoint in status {status!r} (its weights are not "
                             "compressed), which resumerge cannot decode", min(headers, default=None))
    if config.get("kv_cache_scheme"):
        name = telltale(headers, ("k_scale", "v_scale"))
        raise refuse(source, "compressed-tensors kv-cache scales, which resumerge cannot merge", name)
    groups = [g for g in (config.get("config_groups") or {}).values() if isinstance(g, Mapping) and g.get("weights")]
    found, headers = _nvfp4(config, groups, headers, source)
    for ending, what in _REFUSED.items():
        name = telltale(headers, (ending,))
        if name is not None:
            raise refuse(source, f"compressed-tensors with {what}, which resumerge cannot decode", name)
    modules = {n.removesuffix(".weight_scale") for n in headers if n.endswith(".weight_scale")}
    modules |= {n.removesuffix(".weight_packed") for n in headers if n.endswith(".weight_packed")}
    found.update({f"{m}.weight": _weight(m, groups, config.get("format"), headers, source) for m in sorted(modules)})
    claimed = {n for w in found.values() for n in w.stored()}
    for name in sorted(headers):
        if name.endswith(_COMPANIONS) and name not in claimed:
            raise refuse(source, "a compressed-tensors companion without its quantized weight", name, _INCOMPLETE)
    return found


def _nvfp4(config: Mapping[str, Any], groups: list[Mapping[str, Any]], headers: HeaderMap,
           source: str) -> tuple[dict[str, QuantizedTensor], HeaderMap]:
    """The NVFP4 weights of a checkpoint with an ``nvfp4-pack-quantized`` config group (each module storing a
    ``weight_global_scale``: :func:`~resumerge.inputs.quant.nvfp4.nvfp4_weights`), and the headers of every other
    stored tensor, for the other formats' reading."""
    nvfp4_groups = [g for g in groups if str(g.get("format") or config.get("format") or "") == _NVFP4]
    if not nvfp4_groups:
        return {}, headers
    for group in nvfp4_groups:
        args = group["weights"]
        if not (args.get("num_bits") == 4 and args.get("type") == "float" and args.get("group_size") == NVFP4_GROUP
                and args.get("symmetric", True)):
            raise refuse(source, f"an {_NVFP4} config group with weights {dict(args)}, which resumerge cannot decode "
                                 "(it decodes symmetric 4-bit float weights in groups of 16)",
                         min(headers, default=None))
    modules = {n.removesuffix(".weight_global_scale") for n in headers if n.endswith(".weight_global_scale")}
    found = nvfp4_weights("compressed-tensors", modules, headers, source)
    claimed = {n for w in found.values() for n in w.stored()}
    return found, {n: h for n, h in headers.items() if n not in claimed}


def _weight(module: str, groups: list[Mapping[str, Any]], top_format: object, headers: HeaderMap,
            source: str) -> QuantizedTensor:
    packed, plain, scale = f"{module}.weight_packed", f"{module}.weight", f"{module}.weight_scale"
    zero_point, shape_tensor = f"{module}.weight_zero_point", f"{module}.weight_shape"
    codes = packed if packed in headers else plain
    if scale not in headers:
        raise refuse(source, f"a compressed-tensors weight without its scale (looked for {scale})", codes, _INCOMPLETE)
    if codes not in headers:
        raise refuse(source, f"a compressed-tensors scale without its weight (looked for {plain})", scale, _INCOMPLETE)
    if codes == packed and shape_tensor not in headers:
        raise refuse(source, f"a pack-quantized weight without its shape (looked for {shape_tensor})", codes,
                     _INCOMPLETE)
    dtype, shape = headers[codes]
    scale_dtype, scale_shape = headers[scale]
    kind: Kind | None = "ct-packed" if codes == packed else _PLAIN_KINDS.get(dtype)
    if kind is None or len(shape) != 2 or (kind == "ct-packed" and dtype != "I32") or scale_dtype not in _SCALE_DTYPES:
        raise refuse(source, f"a compressed-tensors weight resumerge cannot decode: {dtype} {list(shape)} with a "
                             f"{scale_dtype} scale (it decodes 2-D I32 packed, I8 and F8_E4M3 weights)", codes)
    symmetric = zero_point not in headers
    fits = [g for g in groups if _fits(g["weights"], kind, symmetric, shape, tuple(scale_shape))]
    if len({repr(sorted(g["weights"].items())) for g in fits}) > 1:
        fits = [g for g in fits if _targets(g, module)] or fits
    if not fits or len({repr(sorted(g["weights"].items())) for g in fits}) > 1:
        what = "no config group fits" if not fits else "several config groups fit"
        raise refuse(source, f"{what} this compressed-tensors weight ({dtype} {list(shape)}, scale "
                             f"{list(scale_shape)}), so resumerge cannot tell how to decode it", codes,
                     "check the checkpoint's quantization_config against its tensors")
    group = fits[0]
    args = group["weights"]
    fmt = str(group.get("format") or top_format or "")
    if _FORMATS.get(fmt) != kind and not (fmt == "naive-quantized" and kind == "ct-float"):
        raise refuse(source, f"compressed-tensors format {fmt!r} with a {dtype} weight, which resumerge cannot "
                             "decode (it decodes pack-, naive-, int- and float-quantized)", codes)
    bits = int(args.get("num_bits", 8))
    if kind == "ct-packed" and bits not in PACKABLE_BITS:
        raise refuse(source, f"{bits}-bit pack-quantized weights, whose packing differs between compressed-tensors "
                             "versions; resumerge decodes 2, 4 and 8 bits", codes)
    high = _cols(kind, shape, bits)[1]
    strategy = str(args.get("strategy") or "tensor")
    group_size = int(args["group_size"]) if args.get("group_size") else None
    block, exact = _block(strategy, shape[0], high, group_size, args.get("block_structure"), scale_shape)
    if kind != "ct-packed":
        exact = shape[1]
    if not symmetric:
        _check_zero_point(zero_point, headers, scale_shape, kind, strategy, shape[0], bits, source)
    extras = tuple(f"{module}{e}" for e in _EXTRAS if f"{module}{e}" in headers)
    scheme = Scheme(kind, bits, block, strategy, scale_dtype, symmetric=symmetric, group_size=group_size)
    return QuantizedTensor(plain, codes, scale, scheme, None if exact is None else (shape[0], exact),
                           zero_point=None if symmetric else zero_point,
                           shape_tensor=shape_tensor if kind == "ct-packed" else None, extras=extras)


def _cols(kind: str, shape: tuple[int, ...], bits: int) -> tuple[int, int]:
    """The range the unpacked width can be in (exact for unpacked weights)."""
    if kind != "ct-packed":
        return shape[1], shape[1]
    per = 32 // bits
    return (shape[1] - 1) * per + 1, shape[1] * per


def _fits(args: Mapping[str, Any], kind: str, symmetric: bool, shape: tuple[int, ...],
          scale_shape: tuple[int, ...]) -> bool:
    if (str(args.get("type", "int")) == "float") != (kind == "ct-float"):
        return False
    if bool(args.get("symmetric", True)) != symmetric:
        return False
    strategy = str(args.get("strategy") or "tensor")
    if strategy not in STRATEGIES:
        return False
    low, high = _cols(kind, shape, int(args.get("num_bits", 8)) if kind == "ct-packed" else 8)
    rows = shape[0]
    if strategy == "tensor":
        return all(d == 1 for d in scale_shape)
    if strategy == "channel":
        return scale_shape == (rows, 1)
    if len(scale_shape) != 2:
        return False
    if strategy == "group":
        g = int(args.get("group_size") or 0)
        return g > 0 and scale_shape[0] == rows and low <= scale_shape[1] * g <= high
    bs = args.get("block_structure")
    if not bs:
        return False
    bh, bw = int(bs[0]), int(bs[1])
    return scale_shape[0] == -(-rows // bh) and -(-low // bw) <= scale_shape[1] <= -(-high // bw)


def _block(strategy: str, rows: int, high: int, group_size: int | None, block_structure: Any,
           scale_shape: tuple[int, ...]) -> tuple[tuple[int, int], int | None]:
    """The scale grid's block, and the exact width where the scale shape alone gives it."""
    if strategy == "tensor":
        return (max(rows, 1), max(high, 1)), None
    if strategy == "channel":
        return (1, max(high, 1)), None
    if strategy == "group" and group_size:
        return (1, group_size), scale_shape[1] * group_size
    return (int(block_structure[0]), int(block_structure[1])), None


def _check_zero_point(name: str, headers: HeaderMap, scale_shape: tuple[int, ...], kind: str, strategy: str,
                      rows: int, bits: int, source: str) -> None:
    dtype, shape = headers[name]
    expected: tuple[int, ...]
    if kind == "ct-packed" and strategy in ("group", "channel"):
        expected = (-(-rows * bits // 32), scale_shape[1])
        ok = dtype == "I32" and tuple(shape) == expected
    else:
        expected = scale_shape
        ok = dtype in ("I8", "I32", *_SCALE_DTYPES) and tuple(shape) == tuple(scale_shape)
    if not ok:
        raise refuse(source, f"the zero point {name} is {dtype} {list(shape)}, its scale needs {list(expected)}",
                     name, "the checkpoint is incomplete or damaged: download it again")


def _targets(group: Mapping[str, Any], module: str) -> bool:
    for target in group.get("targets") or ():
        text = str(target)
        if text == module or (text.startswith("re:") and re.match(text[3:], module)):
            return True
    return False


def packed_shape(weight: QuantizedTensor, values: Sequence[int], headers: HeaderMap,
                 source: str = "") -> tuple[int, int]:
    """The exact ``[rows, cols]`` of a pack-quantized ``weight`` from its ``weight_shape`` tensor's ``values``
    (read by the codec: the headers alone bound the width to within one word), checked against the packed words
    and the scale grid. Raises the one-line refusal naming ``weight_shape`` when they disagree."""
    codes_shape, scale_shape = headers[weight.codes][1], tuple(headers[weight.scale][1])
    shape = tuple(int(v) for v in values)
    scheme = weight.scheme
    ok = len(shape) == 2 and shape[0] == codes_shape[0] and packed_cols(shape[1], scheme.bits) == codes_shape[1]
    if ok and weight.shape is not None:
        ok = shape == weight.shape
    if ok and scheme.strategy in ("group", "block") and scheme.block is not None:
        ok = grid_shape((shape[0], shape[1]), scheme.block) == scale_shape
    if not ok:
        raise refuse(source, f"weight_shape says {list(shape)}, which does not fit the packed {list(codes_shape)} "
                             f"{scheme.bits}-bit words and the {list(scale_shape)} scale", weight.shape_tensor,
                     "the checkpoint is damaged: download it again")
    return shape[0], shape[1]
