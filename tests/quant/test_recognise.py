"""Format recognition from quantization_config plus headers: verdicts per tensor, and the one-line refusals."""

from __future__ import annotations

from typing import Any

import pytest

from resumerge.errors import EXIT_INVALID, ModelInputError, exit_code_for
from resumerge.inputs.codecs import CODECS
from resumerge.inputs.quant.recognise_ct import packed_shape
from resumerge.inputs.quant.refusals import HeaderMap, refuse_gguf
from resumerge.inputs.quant.verdict import TensorRole

# The verdict of the format that claims a checkpoint's quant_method (each format's own recognition, one path).
recognise = CODECS.verdict

FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# DeepSeek-V3's shapes (simpx/model-inspect), split over two "shards" the way its index does: the scale of
# o_proj sits in the other file. The headers handed in are the whole checkpoint's.
SHARD_1: HeaderMap = {
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ("F8_E4M3", (576, 7168)),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ("F32", (5, 56)),
    "model.layers.0.self_attn.o_proj.weight": ("F8_E4M3", (7168, 16384)),
    "model.layers.0.input_layernorm.weight": ("BF16", (7168,)),
    "model.layers.3.mlp.gate.weight": ("BF16", (256, 7168)),
    "model.layers.3.mlp.gate.e_score_correction_bias": ("F32", (256,)),
}
SHARD_2: HeaderMap = {"model.layers.0.self_attn.o_proj.weight_scale_inv": ("F32", (56, 128)),
                      "model.embed_tokens.weight": ("BF16", (129280, 7168))}
CT_INT4: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
    "ignore": ["lm_head"],  # not what decides: the headers do
}
EXPERT = "model.layers.1.mlp.experts.0.down_proj"


def _one_line(config: dict[str, Any] | None, headers: HeaderMap) -> str:
    with pytest.raises(ModelInputError) as caught:
        recognise(config, headers, source="models/parent")
    assert exit_code_for(caught.value) == EXIT_INVALID
    line = caught.value.one_line()
    assert "\n" not in line and line.startswith("models/parent: ")
    return line


def test_block_fp8_weights_and_their_scales_across_shards() -> None:
    verdict = recognise(FP8, {**SHARD_1, **SHARD_2})
    assert verdict.format == "fp8"
    assert set(verdict.quantized) == {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                      "model.layers.0.self_attn.o_proj.weight"}
    o_proj = verdict.quantized["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj.scale == "model.layers.0.self_attn.o_proj.weight_scale_inv"
    assert o_proj.scheme.block == (128, 128) and o_proj.shape == (7168, 16384)
    assert verdict.roles["model.layers.0.self_attn.o_proj.weight_scale_inv"] == TensorRole(
        "companion", "model.layers.0.self_attn.o_proj.weight")
    assert verdict.roles["model.layers.3.mlp.gate.weight"] == TensorRole("other")
    assert verdict.role_counts() == {"weight": 2, "companion": 2, "other": 4}


def test_ue8m0_scale_format_is_carried() -> None:
    verdict = recognise({**FP8, "scale_fmt": "ue8m0"}, {**SHARD_1, **SHARD_2})
    assert {w.scheme.scale_fmt for w in verdict.quantized.values()} == {"ue8m0"}


def test_compressed_tensors_int4_experts_are_decided_from_the_headers() -> None:
    headers: HeaderMap = {
        f"{EXPERT}.weight_packed": ("I32", (7168, 256)),
        f"{EXPERT}.weight_scale": ("BF16", (7168, 64)),
        f"{EXPERT}.weight_shape": ("I32", (2,)),
        "model.layers.1.self_attn.q_proj.weight": ("BF16", (64, 7168)),  # "Linear" targets it; it is not quantized
        "lm_head.weight": ("BF16", (1000, 7168)),
    }
    verdict = recognise(CT_INT4, headers)
    weight = verdict.quantized[f"{EXPERT}.weight"]
    assert weight.codes == f"{EXPERT}.weight_packed" and weight.shape_tensor == f"{EXPERT}.weight_shape"
    assert weight.scheme.kind == "ct-packed" and weight.scheme.bits == 4 and weight.scheme.block == (1, 32)
    assert weight.shape == (7168, 2048) and weight.scheme.scale_dtype == "BF16"
    assert verdict.role_counts() == {"weight": 1, "companion": 2, "other": 2}


def test_asymmetric_channel_weights_and_mixed_groups_by_target() -> None:
    config = {
        "quant_method": "compressed-tensors", "format": "mixed-precision",
        "config_groups": {
            "int8": {"targets": ["re:.*self_attn.*"], "format": "naive-quantized", "weights": {
                "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}},
            "int8b": {"targets": ["re:.*mlp.*"], "format": "naive-quantized", "weights": {
                "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}},
            "int4": {"targets": ["re:.*experts.*"], "format": "pack-quantized", "weights": {
                "num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"}},
        },
    }
    headers: HeaderMap = {
        "a.self_attn.q.weight": ("I8", (10, 20)), "a.self_attn.q.weight_scale": ("F32", (10, 1)),
        "a.mlp.up.weight": ("I8", (10, 20)), "a.mlp.up.weight_scale": ("F32", (1,)),
        "a.experts.0.weight_packed": ("I32", (10, 3)), "a.experts.0.weight_scale": ("BF16", (10, 1)),
        "a.experts.0.weight_shape": ("I64", (2,)), "a.experts.0.weight_zero_point": ("I32", (2, 1)),
    }
    verdict = recognise(config, headers)
    assert verdict.quantized["a.self_attn.q.weight"].scheme.strategy == "channel"
    assert verdict.quantized["a.mlp.up.weight"].scheme.strategy == "tensor"
    expert = verdict.quantized["a.experts.0.weight"]
    assert not expert.scheme.symmetric and expert.zero_point == "a.experts.0.weight_zero_point"
    assert expert.shape is None and expert.scheme.block == (1, 24)  # the width is weight_shape's to say


def test_mxfp4_experts() -> None:
    config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    stem = "model.layers.0.mlp.experts"
    headers: HeaderMap = {
        f"{stem}.gate_up_proj_blocks": ("U8", (32, 5760, 90, 16)),
        f"{stem}.gate_up_proj_scales": ("U8", (32, 5760, 90)),
        f"{stem}.gate_up_proj_bias": ("BF16", (32, 5760)), "model.layers.0.mlp.router.weight": ("BF16", (32, 2880)),
    }
    verdict = recognise(config, headers)
    weight = verdict.quantized[f"{stem}.gate_up_proj"]
    assert weight.shape == (32, 2880, 5760) and weight.scheme.kind == "mxfp4"
    assert verdict.roles[f"{stem}.gate_up_proj_bias"] == TensorRole("other")


def test_a_plain_checkpoint_is_all_other() -> None:
    verdict = recognise(None, {"a.weight": ("BF16", (2, 2)), "b.weight": ("F8_E4M3", (2, 2))})
    assert verdict.format is None and verdict.role_counts() == {"weight": 0, "companion": 0, "other": 2}


@pytest.mark.parametrize(("method", "tensors", "label", "tensor"), [
    ("bitsandbytes", {"x.weight": ("U8", (8, 1)), "x.weight.absmax": ("F32", (4,))}, "bitsandbytes",
     "x.weight.absmax"),
    ("gptq", {"x.qweight": ("I32", (8, 8)), "x.qzeros": ("I32", (1, 8)), "x.scales": ("F16", (1, 64))}, "GPTQ",
     "x.qweight"),
    ("awq", {"x.qweight": ("I32", (8, 8)), "x.scales": ("F16", (1, 64))}, "AWQ", "x.qweight"),
    ("auto-round", {"x.qweight": ("I32", (8, 8))}, "AutoRound", "x.qweight"),
    ("hqq", {"x.W_q": ("U8", (8, 8))}, "HQQ", "x.W_q"),
    ("torchao", {"x.weight": ("BF16", (8, 8))}, "torchao", "x.weight"),
    ("nvfp4", {"x.weight": ("U8", (8, 4)), "x.weight_global_scale": ("F32", ())}, "NVFP4", "x.weight"),
    ("fbgemm_fp8", {"x.weight": ("F8_E4M3", (8, 8))}, "fbgemm FP8", "x.weight"),
])
def test_unsupported_formats_are_refused_in_one_line(method: str, tensors: HeaderMap, label: str,
                                                      tensor: str) -> None:
    line = _one_line({"quant_method": method}, tensors)
    assert f"quantized with {label}, which resumerge cannot decode: {tensor} — dequantize it with its own tool" in line


def test_an_unknown_method_is_refused() -> None:
    line = _one_line({"quant_method": "zipnn-4"}, {"x.weight": ("BF16", (1,))})
    assert "unknown quantization method 'zipnn-4'" in line and "x.weight" in line and "dequantize it" in line


@pytest.mark.parametrize(("tensors", "words"), [
    ({"x.qweight": ("I32", (8, 8))}, "GPTQ or AWQ or AutoRound"),
    ({"x.weight": ("U8", (8, 1)), "x.weight.quant_state.bitsandbytes__nf4": ("U8", (9,))}, "bitsandbytes"),
    ({"x.weight": ("F8_E4M3", (8, 8)), "x.weight_scale_inv": ("F32", (1, 1))}, "no quantization_config"),
])
def test_quantized_tensors_without_a_quantization_config_are_refused(tensors: HeaderMap, words: str) -> None:
    assert words in _one_line(None, tensors)


def test_gguf_files_are_refused_by_their_magic() -> None:
    refuse_gguf(b"\x10\x00\x00\x00\x00\x00\x00\x00{", "model.safetensors")
    with pytest.raises(ModelInputError) as caught:
        refuse_gguf(b"GGUF\x03\x00\x00\x00", "model-q4_k_m.gguf")
    assert exit_code_for(caught.value) == EXIT_INVALID
    assert caught.value.one_line().startswith("model-q4_k_m.gguf: a GGUF file, not safetensors")


@pytest.mark.parametrize(("config", "tensors", "words", "tensor"), [
    (FP8, {"a.weight": ("F8_E4M3", (300, 270))}, "an fp8 weight without its scale", "a.weight"),
    (FP8, {"a.weight": ("F8_E4M3", (300, 270)), "a.weight_scale_inv": ("F32", (3, 2))},
     "needs [3, 3]", "a.weight"),
    (FP8, {"a.weight_scale_inv": ("F32", (3, 2))}, "an fp8 scale without its weight", "a.weight_scale_inv"),
    ({"quant_method": "mxfp4"}, {"e.down_blocks": ("U8", (2, 4, 3, 16))}, "without its scales", "e.down_blocks"),
    ({"quant_method": "mxfp4"}, {"e.down_blocks": ("U8", (2, 4, 3, 16)), "e.down_scales": ("U8", (2, 4, 2))},
     "need [2, 4, 3]", "e.down_blocks"),
    (CT_INT4, {"m.weight_packed": ("I32", (4, 4)), "m.weight_shape": ("I64", (2,))}, "without its scale",
     "m.weight_packed"),
    (CT_INT4, {"m.weight_packed": ("I32", (4, 4)), "m.weight_scale": ("BF16", (4, 1))}, "without its shape",
     "m.weight_packed"),
    (CT_INT4, {"m.weight_packed": ("I32", (4, 4)), "m.weight_scale": ("BF16", (4, 3)),
               "m.weight_shape": ("I64", (2,))}, "no config group fits", "m.weight_packed"),
    (CT_INT4, {"m.weight_zero_point": ("I32", (1, 1))}, "companion without its quantized weight",
     "m.weight_zero_point"),
    ({**CT_INT4, "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 3, "type": "int",
                                                                            "strategy": "channel"}}}},
     {"m.weight_packed": ("I32", (4, 2)), "m.weight_scale": ("BF16", (4, 1)), "m.weight_shape": ("I64", (2,))},
     "3-bit pack-quantized", "m.weight_packed"),
    (CT_INT4, {"m.weight_packed": ("I32", (4, 4)), "m.weight_scale": ("BF16", (4, 1)),
               "m.weight_g_idx": ("I32", (32,))}, "activation-ordered groups", "m.weight_g_idx"),
])
def test_broken_or_undecodable_quantized_weights_name_the_tensor(config: dict[str, Any], tensors: HeaderMap,
                                                                  words: str, tensor: str) -> None:
    line = _one_line(config, tensors)
    assert words in line and tensor in line


def test_the_packed_width_comes_from_weight_shape_and_is_checked() -> None:
    headers: HeaderMap = {"m.weight_packed": ("I32", (10, 3)), "m.weight_scale": ("F32", (10, 1)),
                          "m.weight_shape": ("I64", (2,))}
    config = {**CT_INT4, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}}}
    weight = recognise(config, headers).quantized["m.weight"]
    assert weight.shape is None
    assert packed_shape(weight, [10, 20], headers) == (10, 20)
    for wrong in ([10, 30], [9, 20], [10]):
        with pytest.raises(ModelInputError) as caught:
            packed_shape(weight, wrong, headers, "models/parent")
        assert "m.weight_shape" in caught.value.one_line() and "does not fit" in caught.value.one_line()
