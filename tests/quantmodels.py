"""Tiny quantized checkpoints for the codec tests, built from a generated plain model, and the independent decoders
their merges are checked against (DeepSeek's block-FP8 formula, compressed-tensors' INT4 unpacking, gpt-oss' MXFP4
table), written out element by element here rather than taken from the kernels under test — or, for
compressed-tensors, compressed and decompressed by the library itself (a test-only dependency)."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from resumerge.inputs.quant import compressed_tensors as ct
from resumerge.inputs.quant import fp8_block, mxfp4

SCALES_FILE = "scales.safetensors"
Quantizer = Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None]


def deepseek_dequant(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3's README_WEIGHTS.md: every element of (128x128 weight block) times its weight_scale_inv."""
    rows, cols = codes.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(math.ceil(rows / block[0])):
        for j in range(math.ceil(cols / block[1])):
            r = slice(i * block[0], (i + 1) * block[0])
            c = slice(j * block[1], (j + 1) * block[1])
            out[r, c] = codes[r, c].to(torch.float32) * scale_inv[i, j].to(torch.float32)
    return out


def int4_dequant(words: torch.Tensor, scale: torch.Tensor, cols: int, group: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized INT4: eight 4-bit values per int32, lowest nibble first, stored with an
    offset of 8; value = (nibble - 8) * scale of its group of ``group`` columns."""
    rows = words.shape[0]
    out = torch.empty(rows, cols, dtype=torch.float32)
    as_int = words.to(torch.int64) & 0xFFFFFFFF
    for j in range(cols):
        nibble = (as_int[:, j // 8] >> (4 * (j % 8))) & 0xF
        out[:, j] = (nibble - 8).to(torch.float32) * scale[:, j // group].to(torch.float32)
    return out


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' ``convert_moe_packed_tensors``: low nibble first, times 2^(scale - 127), to [..., in, out]."""
    *lead, rows, groups, width = blocks.shape
    lut = torch.tensor(_E2M1)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).reshape(*lead, rows, groups, width * 2)
    values = values * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)
    return values.reshape(*lead, rows, groups * width * 2).transpose(-1, -2).contiguous()


def quantize_model(directory: Path, reference: Path, quantizer: Quantizer, config: dict[str, object],
                   extra: dict[str, torch.Tensor] | None = None) -> None:
    """Store the tensors of the model at ``directory`` that ``quantizer(name, tensor)`` returns parts for (the
    stored tensors replacing it: the codes under their name in the same shard, every companion in a shard of their
    own) with ``config`` as ``quantization_config``; ``extra`` adds plain tensors first (to be quantized like the
    others). ``reference`` becomes the same model with every quantized tensor replaced by its value decoded by the
    ``decode`` the quantizer's parts carry (the ``"value"`` entry, not stored)."""
    shutil.copytree(directory, reference)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    companions: dict[str, torch.Tensor] = {}
    files = sorted(set(index["weight_map"].values()))
    reference_index = json.loads(json.dumps(index))
    reference_index["weight_map"].update(dict.fromkeys(extra or {}, files[-1]))
    for file in files:
        tensors, plain = load_file(directory / file), load_file(reference / file)
        if extra and file == files[-1]:
            tensors.update(extra)
            plain.update(extra)
            index["weight_map"].update(dict.fromkeys(extra, file))
        for name, t in list(tensors.items()):
            parts = quantizer(name, t)
            if parts is None:
                continue
            del tensors[name], plain[name]
            plain[name.removesuffix("_blocks")] = parts.pop("value")
            codes = next(iter(parts))
            tensors[codes] = parts.pop(codes)
            index["weight_map"].pop(name)
            index["weight_map"][codes] = file
            companions.update(parts)
        save_file(tensors, directory / file, metadata={"format": "pt"})
        save_file(plain, reference / file, metadata={"format": "pt"})
    save_file(companions, directory / SCALES_FILE, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(companions, SCALES_FILE))
    index_path.write_text(json.dumps(index))
    (reference / "model.safetensors.index.json").write_text(json.dumps(reference_index))
    model_config = json.loads((directory / "config.json").read_text())
    model_config["quantization_config"] = config
    (directory / "config.json").write_text(json.dumps(model_config))


def _projection(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def fp8(block: tuple[int, int], *, ue8m0: bool = False) -> Quantizer:
    """Block FP8 of every projection (DeepSeek's rule; with ``ue8m0``, power-of-two scales stored as F8_E8M0),
    decoded by DeepSeek's formula."""

    def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not _projection(name, t):
            return None
        codes, scale = fp8_block.encode(t.to(torch.float32), block, scale_fmt="ue8m0" if ue8m0 else "float",
                                        scale_dtype=torch.float8_e8m0fnu if ue8m0 else torch.float32)
        return {name: codes, f"{name}_scale_inv": scale, "value": deepseek_dequant(codes, scale, block)}

    return quantize


def fp8_config(block: tuple[int, int], *, ue8m0: bool = False) -> dict[str, object]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            **({"scale_fmt": "ue8m0"} if ue8m0 else {})}


def int4(group: int | None) -> Quantizer:
    """compressed-tensors pack-quantized symmetric INT4 with ``group`` columns per scale (None: one per row)."""

    def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not _projection(name, t):
            return None
        rows, cols = t.shape
        words, scale, _ = ct.quantize(t.to(torch.float32), (1, group or cols), bits=4, packed=True)
        module = name.removesuffix("weight")
        return {f"{module}weight_packed": words, f"{module}weight_scale": scale,
                f"{module}weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
                "value": int4_dequant(words, scale, cols, group or cols)}

    return quantize


def int4_config(group: int | None) -> dict[str, object]:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group" if group else "channel",
               "group_size": group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}},
            "ignore": ["lm_head"]}


def experts(layers: int, count: int, inputs: int, outputs: int, seed: int) -> dict[str, torch.Tensor]:
    """gpt-oss-style fused expert weights ``[experts, in, out]`` for each layer (as transformers holds them)."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.experts.down_proj": torch.randn(count, inputs, outputs, generator=g) * 0.02
            for i in range(layers)}


def mxfp4_experts(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """MXFP4 of every fused expert weight, stored as ``X_blocks`` / ``X_scales``."""
    if t.dim() != 3:
        return None
    blocks, scales = mxfp4.encode(t.to(torch.float32))
    return {f"{name}_blocks": blocks, f"{name}_scales": scales, "value": mxfp4_dequant(blocks, scales)}


MXFP4_CONFIG: dict[str, object] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}


def fused_fp8(block: tuple[int, int]) -> Quantizer:
    """Block FP8 of every fused expert weight ``[experts, rows, cols]`` (scales ``[experts, grid rows, grid
    cols]``, as real fused MoE checkpoints store them), each expert decoded by DeepSeek's formula."""

    def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if t.dim() != 3:
            return None
        encoded = [fp8_block.encode(m.to(torch.float32), block) for m in t]
        codes, scales = torch.stack([c for c, _ in encoded]), torch.stack([s for _, s in encoded])
        value = torch.stack([deepseek_dequant(c, s, block) for c, s in encoded])
        return {name: codes, f"{name}_scale_inv": scales, "value": value}

    return quantize


def library_extremes(w: torch.Tensor, strategy: str, group_size: int | None,
                     block: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale min and max of ``w``, computed the plain way (compressed-tensors' observers do the same)."""
    rows, cols = w.shape
    if strategy == "tensor":
        return w.min().reshape(1), w.max().reshape(1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy == "group":
        assert group_size is not None
        g = w.view(rows, cols // group_size, group_size)
        return g.amin(-1), g.amax(-1)
    assert block is not None
    bh, bw = block
    low = torch.empty(math.ceil(rows / bh), math.ceil(cols / bw))
    high = torch.empty_like(low)
    for i in range(low.shape[0]):
        for j in range(low.shape[1]):
            part = w[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw]
            low[i, j], high[i, j] = part.min(), part.max()
    return low, high


# (module pattern, compressed-tensors weight arguments, format) of each config group of a mixed checkpoint.
CtGroup = tuple[str, dict[str, Any], str]


def ct_library(groups: list[CtGroup], *, static: bool = False) -> Quantizer:
    """compressed-tensors' own compressors over every projection whose module matches a group's pattern (the first
    that does), decoded by the same library's decompress; with ``static``, each quantized module also gets a
    one-value ``input_scale`` (static activation quantization, which no weight determines)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        module = name.removesuffix(".weight")
        found = next((g for g in groups if _projection(name, t) and re.match(g[0], module)), None)
        if found is None:
            return None
        args = QuantizationArgs(**found[1])
        compressor = PackedQuantizationCompressor if found[2] == "pack-quantized" else NaiveQuantizationCompressor
        w = t.to(torch.float32)
        extremes = library_extremes(w, str(args.strategy), args.group_size, args.block_structure)
        scale, zero_point = calculate_qparams(*extremes, args)
        state = {"weight": w.clone(), "weight_scale": scale}
        if not args.symmetric:
            state["weight_zero_point"] = zero_point
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        stored = compressor.compress(dict(state), scheme)
        value = compressor.decompress(dict(stored), scheme)["weight"].to(torch.float32)
        codes = "weight_packed" if "weight_packed" in stored else "weight"
        parts = {f"{module}.{codes}": stored.pop(codes), **{f"{module}.{k}": v for k, v in stored.items()}}
        if static:
            parts[f"{module}.input_scale"] = (w.abs().amax() / 448).reshape(1)
        return {**parts, "value": value}

    return quantize


def ct_config(groups: list[CtGroup], *, static: bool = False) -> dict[str, object]:
    """The quantization_config of a :func:`ct_library` checkpoint: one config group per group, targeting its
    modules by pattern, with its own format."""
    activations = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False} if static else None
    return {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
            "config_groups": {f"group_{i}": {"targets": [f"re:{pattern}$"], "weights": args, "format": fmt,
                                             "input_activations": activations}
                              for i, (pattern, args, fmt) in enumerate(groups)},
            "ignore": ["lm_head"]}


# NVFP4: E2M1 magnitudes by code, the block size, and the two configs of its two safetensors producers.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_GROUP = 16
MODELOPT_CONFIG: dict[str, object] = {
    "quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
    "producer": {"name": "modelopt", "version": "0.37.0"}, "exclude_modules": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                  "input_activations": {"num_bits": 4, "type": "float", "group_size": 16}}},
    "ignore": ["lm_head"]}
NVFP4_CT_ARGS: dict[str, object] = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                    "symmetric": True, "dynamic": False, "observer": "minmax"}
NVFP4_CT_CONFIG: dict[str, object] = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": NVFP4_CT_ARGS, "input_activations": None,
                                  "format": "nvfp4-pack-quantized"}},
    "ignore": ["lm_head"]}


def _e2m1_index(x: torch.Tensor) -> torch.Tensor:
    """The index of the E2M1 magnitude nearest ``|x|`` (saturating at 6), a tie to the even index: by distance to
    each of the eight, not by thresholds."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    distance = (x.abs().to(torch.float64).clamp(max=6.0).unsqueeze(-1) - table).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = distance == best
    even = candidates & (torch.arange(8) % 2 == 0)
    return torch.where(even.any(-1), even.to(torch.int64).argmax(-1), candidates.to(torch.int64).argmax(-1))


# The sibling projections vLLM fuses into one GEMM in the tiny llama models (q/k/v, gate/up): one NVFP4 tensor scale.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_group(name: str) -> tuple[str, ...]:
    """The output weights sharing ``name``'s NVFP4 tensor scale (its fused siblings, itself among them, in
    :data:`FUSED`'s order), or ``(name,)``."""
    parent, _, child = name.removesuffix(".weight").rpartition(".")
    found = next((fused for fused in FUSED if child in fused), (child,))
    return tuple(f"{parent}.{c}.weight" for c in found)


def modelopt_nvfp4(w: torch.Tensor, amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """NVIDIA ModelOpt's NVFP4 export of one Linear weight, as reference/kquants.md §7 gives its formula:
    ``weight_scale_2 = amax / (6 · 448)`` (``amax``: the largest magnitude over the weight's fused group, when it has
    one: ModelOpt takes the largest of the group's amaxes), ``weight_scale = fp8(block_amax / (6 · weight_scale_2))``
    (a zero block: 1.0), codes E2M1 of ``W / (fp32(weight_scale) · weight_scale_2)`` ties to even, +0 for every zero,
    byte k = ``q[2k] | q[2k+1] << 4``; with the value it dequantizes to, ``E2M1 · weight_scale · weight_scale_2``."""
    w = w.to(torch.float32)
    rows, cols = w.shape
    scale_2 = (w.abs().max() if amax is None else amax.to(torch.float32)) / (6 * 448)
    blocks = w.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    weight_scale = (blocks.abs().amax(-1) / (6 * scale_2)).to(torch.float8_e4m3fn).to(torch.float32)
    weight_scale = torch.where(weight_scale == 0, 1.0, weight_scale).to(torch.float8_e4m3fn)
    per = weight_scale.to(torch.float32) * scale_2
    index = _e2m1_index(blocks / per.unsqueeze(-1))
    negative = (blocks < 0) & (index > 0)
    codes = (index | (negative.to(torch.int64) << 3)).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)[index]
    value = torch.where(negative, -magnitude, magnitude) * per.unsqueeze(-1)
    return {"weight": packed, "weight_scale": weight_scale, "weight_scale_2": scale_2.reshape(()),
            "value": value.reshape(rows, cols)}


def modelopt_quantizer(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """ModelOpt NVFP4 of every projection (:func:`modelopt_nvfp4`), with a static ``input_scale``."""
    if not _projection(name, t):
        return None
    module = name.removesuffix(".weight")
    parts = modelopt_nvfp4(t)
    return {name: parts["weight"], f"{module}.weight_scale": parts["weight_scale"],
            f"{module}.weight_scale_2": parts["weight_scale_2"],
            f"{module}.input_scale": (t.abs().amax() / (6 * 448)).to(torch.float32).reshape(()),
            "value": parts["value"]}


def ct_global_scale(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' global scale of one weight (its minmax observer's ``generate_gparam``), float32 [1]."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    w = w.to(torch.float32)
    return generate_gparam(w.min(), w.max())


def ct_fused_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """The global scale a fused group's members share, as llm-compressor's ``update_fused_layer_weight_global_scales``
    sets it after each member's observer: the smallest of the members' own (:func:`ct_global_scale`)."""
    return torch.min(torch.cat([ct_global_scale(w) for w in weights])).reshape([1])


def compressed_tensors_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors' own NVFP4 of one weight (its observer's global scale, or ``global_scale`` given, a fused
    group's; its block scales, its ``NVFP4PackedCompressor.compress``), with the float32 value its dequantize gives
    (``"value"``; checked equal, rounded, to the bfloat16 its ``decompress`` returns)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = QuantizationArgs(**{k: v for k, v in NVFP4_CT_ARGS.items() if k != "observer"},
                            scale_dtype=torch.float8_e4m3fn)
    w = w.to(torch.float32)
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    global_scale = generate_gparam(w.min(), w.max()) if global_scale is None else global_scale
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=global_scale)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    stored = NVFP4PackedCompressor.compress({"weight": w.clone(), "weight_scale": scale,
                                              "weight_global_scale": global_scale}, scheme)
    decoded = NVFP4PackedCompressor.decompress(dict(stored), scheme)["weight"]
    # The library's own unpacking and dequantize, in float32 (its decompress rounds that value to bfloat16).
    codes = unpack_fp4_from_uint8(stored["weight_packed"], rows, cols, dtype=torch.float32)
    value = dequantize(x_q=codes, scale=stored["weight_scale"].to(torch.float32), args=args,
                       global_scale=stored["weight_global_scale"], dtype=torch.float32)
    assert torch.equal(value.to(torch.bfloat16), decoded)
    return {**stored, "value": value}


def ct_nvfp4_quantizer(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """compressed-tensors NVFP4 of every projection (:func:`compressed_tensors_nvfp4`); the reference value is the
    library's dequantize of the stored parts in float32."""
    if not _projection(name, t):
        return None
    module = name.removesuffix(".weight")
    parts = compressed_tensors_nvfp4(t)
    value = parts.pop("value")
    return {f"{module}.weight_packed": parts["weight_packed"], f"{module}.weight_scale": parts["weight_scale"],
            f"{module}.weight_global_scale": parts["weight_global_scale"], "value": value}
