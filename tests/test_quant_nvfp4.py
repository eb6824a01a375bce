"""NVFP4 checkpoints end to end: a linear merge of two tiny ModelOpt NVFP4 models, and of two compressed-tensors
``nvfp4-pack-quantized`` ones (made by the library itself), gives the bytes the same merge of the two models decoded
independently (ModelOpt's formula, compressed-tensors' decompress) gives; kept in the base's format, each weight is
stored as its producer would store that merged value (fresh scales; q/k/v and gate/up with the tensor scale of their
fused group, as vLLM loads them) and config.json keeps the base's quantization_config; ``verify`` reads the output
back through the codec. Variants resumerge does not decode are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ModelFactory
from quantmodels import (
    MODELOPT_CONFIG,
    NVFP4_CT_CONFIG,
    Quantizer,
    compressed_tensors_nvfp4,
    ct_fused_global_scale,
    ct_nvfp4_quantizer,
    fused_group,
    modelopt_nvfp4,
    modelopt_quantizer,
    quantize_model,
)
from safetensors.torch import load_file
from support import linear_config, write_config
from test_quant_codecs import merge

from resumerge.config.merge_config import load_config_text
from resumerge.errors import ModelInputError
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS, Nvfp4Codec
from resumerge.merge.store.formatcheck import check_formats

pytest.importorskip("compressed_tensors")

# hidden 32 and intermediate 48: every projection's input width is whole blocks of 16.
SPEC = {"layers": 2, "hidden": 32, "intermediate": 48, "shard_bytes": 20_000}
PROJECTIONS = 2 * 7


def pair(tmp_path: Path, make: ModelFactory, quantizer: Quantizer, config: dict[str, object]) -> list[Path]:
    models = []
    for name, seed in (("a", 1), ("b", 2)):
        directory = make(name, seed=seed, **SPEC)
        quantize_model(directory, tmp_path / f"{name}-decoded", quantizer, config)
        models.append(directory)
    return models


def assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_modelopt_merge_round_trips_through_nvfp4(tmp_path: Path, make: ModelFactory) -> None:
    a, b = pair(tmp_path, make, modelopt_quantizer, MODELOPT_CONFIG)
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want", dequantize=True)
    got = merge(tmp_path, a, b, "got", dequantize=True)
    assert not any(n.endswith(("weight_scale", "weight_scale_2", "input_scale")) for n in got)
    assert_same_bytes(got, want)
    # Kept in the base's format: each merged value as ModelOpt stores it (the formula, fresh scales), the static
    # input_scale carried from the base, config.json's quantization_config the base's.
    kept = merge(tmp_path, a, b, "kept", dequantize=False)
    base = load_file(a / "scales.safetensors")
    expected = {n: t for n, t in want.items() if not n.endswith("_proj.weight")}
    for name in set(want) - set(expected):
        module = name.removesuffix(".weight")
        # q/k/v and gate/up share one weight_scale_2: the largest magnitude over the merged group
        parts = modelopt_nvfp4(want[name], torch.stack([want[m].abs().max() for m in fused_group(name)]).max())
        expected.update({name: parts["weight"], f"{module}.weight_scale": parts["weight_scale"],
                         f"{module}.weight_scale_2": parts["weight_scale_2"],
                         f"{module}.input_scale": base[f"{module}.input_scale"]})
    assert len(set(want) - {n for n in want if not n.endswith("_proj.weight")}) == PROJECTIONS
    assert_same_bytes(kept, expected)
    out_config = json.loads((tmp_path / "kept" / "config.json").read_text())
    assert out_config["quantization_config"] == MODELOPT_CONFIG
    found, problems = check_formats(tmp_path / "kept", [p.name for p in (tmp_path / "kept").glob("*.safetensors")],
                                    None)
    assert problems == [] and found == {"format": "modelopt", "roles": {
        "weight": PROJECTIONS, "companion": 3 * PROJECTIONS, "other": len(expected) - 4 * PROJECTIONS}}


def test_compressed_tensors_nvfp4_merge_round_trips_through_its_format(tmp_path: Path, make: ModelFactory) -> None:
    a, b = pair(tmp_path, make, ct_nvfp4_quantizer, NVFP4_CT_CONFIG)
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want", dequantize=True)
    got = merge(tmp_path, a, b, "got", dequantize=True)
    assert_same_bytes(got, want)
    kept = merge(tmp_path, a, b, "kept", dequantize=False)
    expected = {n: t for n, t in got.items() if not n.endswith("_proj.weight")}
    for name in set(got) - set(expected):
        module = name.removesuffix(".weight")
        # The library's compress of the merged value, with the global scale its fused group shares
        shared = ct_fused_global_scale([got[m] for m in fused_group(name)])
        parts = compressed_tensors_nvfp4(got[name], shared)
        expected.update({f"{module}.{p}": parts[p] for p in ("weight_packed", "weight_scale", "weight_global_scale")})
    assert_same_bytes(kept, expected)
    out_config = json.loads((tmp_path / "kept" / "config.json").read_text())
    assert out_config["quantization_config"] == NVFP4_CT_CONFIG
    found, problems = check_formats(tmp_path / "kept", [p.name for p in (tmp_path / "kept").glob("*.safetensors")],
                                    None)
    assert problems == [] and found is not None and found["format"] == "compressed-tensors"
    assert found["roles"]["weight"] == PROJECTIONS and found["roles"]["companion"] == 2 * PROJECTIONS
    # As verify judges it after a run, which records the output's codec by name ("nvfp4"): read by the method the
    # config names (compressed-tensors), not by ModelOpt's.
    recorded = {"output": {"format": "nvfp4", "roles": found["roles"]}}
    shards = [p.name for p in (tmp_path / "kept").glob("*.safetensors")]
    assert check_formats(tmp_path / "kept", shards, recorded) == (found, [])


def test_a_modelopt_export_with_only_hf_quant_config_is_read(tmp_path: Path, make: ModelFactory) -> None:
    a = make("a", seed=1, **SPEC)
    quantize_model(a, tmp_path / "a-decoded", modelopt_quantizer, MODELOPT_CONFIG)
    config = json.loads((a / "config.json").read_text())
    settings = config.pop("quantization_config")
    (a / "config.json").write_text(json.dumps(config))
    (a / "hf_quant_config.json").write_text(json.dumps({
        "producer": settings["producer"], "quantization": {k: v for k, v in settings.items()
                                                           if k in ("quant_algo", "kv_cache_quant_algo",
                                                                    "group_size", "exclude_modules")}}))
    text = write_config(tmp_path / "c.yml", linear_config(a, a)).read_text()
    parsed = load_config_text(text)
    model = open_inputs(parsed).models[str(a)].recognised(CODECS)
    assert model.formats is not None and len(model.formats.claims) == PROJECTIONS
    assert {type(c.codec) for c in model.formats.claims.values()} == {Nvfp4Codec}


def _modelopt_headers() -> dict[str, tuple[str, tuple[int, ...]]]:
    return {"m.q_proj.weight": ("U8", (16, 16)), "m.q_proj.weight_scale": ("F8_E4M3", (16, 2)),
            "m.q_proj.weight_scale_2": ("F32", ()), "m.q_proj.input_scale": ("F32", ())}


@pytest.mark.parametrize(("settings", "extra", "said"), [
    ({"quant_algo": "NVFP4_AWQ"}, {}, "NVIDIA ModelOpt NVFP4 with AWQ pre-quantization scales"),
    ({"quant_algo": "NVFP4"}, {"m.q_proj.pre_quant_scale": ("BF16", (32,))}, "NVFP4 with AWQ pre-quantization"),
    ({"quant_algo": "W4A8_NVFP4_FP8"}, {}, "W4A8 (NVFP4 weights with FP8 activations"),
    ({"quant_algo": "FP8"}, {}, "NVIDIA ModelOpt FP8 (per-tensor)"),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"m.q_proj": {"quant_algo": "W4A16_AWQ"}}}, {},
     "W4A16 AWQ"),
    ({"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}, {"m.k_proj.k_scale": ("F32", ())}, "KV-cache scales"),
])
def test_modelopt_variants_are_refused_by_name(settings: dict[str, object],
                                               extra: dict[str, tuple[str, tuple[int, ...]]], said: str) -> None:
    with pytest.raises(ModelInputError) as caught:
        CODECS.verdict({"quant_method": "modelopt", **settings}, {**_modelopt_headers(), **extra}, source="m")
    line = caught.value.one_line()
    assert said in line and "\n" not in line


def test_mixed_precision_of_nvfp4_layers_is_decoded() -> None:
    verdict = CODECS.verdict({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                              "quantized_layers": {"m.q_proj": {"quant_algo": "NVFP4", "group_size": 16}}},
                             _modelopt_headers(), source="m")
    assert verdict.format == "modelopt" and list(verdict.quantized) == ["m.q_proj.weight"]
    assert verdict.role_counts() == {"weight": 1, "companion": 3, "other": 0}


def test_a_broken_nvfp4_scale_is_refused_naming_it() -> None:
    headers = {**_modelopt_headers(), "m.q_proj.weight_scale": ("F8_E4M3", (16, 3))}
    with pytest.raises(ModelInputError, match=r"the NVFP4 scale m.q_proj.weight_scale has shape \[16, 3\]"):
        CODECS.verdict({"quant_method": "modelopt", "quant_algo": "NVFP4"}, headers, source="m")


def test_an_asymmetric_nvfp4_group_is_refused() -> None:
    config = json.loads(json.dumps(NVFP4_CT_CONFIG))
    config["config_groups"]["group_0"]["weights"]["symmetric"] = False
    headers = {"m.q_proj.weight_packed": ("U8", (16, 16)), "m.q_proj.weight_scale": ("F8_E4M3", (16, 2)),
               "m.q_proj.weight_global_scale": ("F32", (1,))}
    with pytest.raises(ModelInputError, match="nvfp4-pack-quantized config group with weights"):
        CODECS.verdict(config, headers, source="m")


def test_nvfp4_scales_without_any_quantization_config_are_refused() -> None:
    with pytest.raises(ModelInputError, match="a quantization companion but no quantization_config"):
        CODECS.verdict(None, _modelopt_headers(), source="m")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_nvfp4_tensor_is_gguf_py_s_decode_times_its_scale(tmp_path: Path, arch: str) -> None:
    # llama.cpp's converter: ModelOpt's blocks as NVFP4 (type 40), weight_scale_2 as F32 `<name>.scale`, the
    # input scale as `<name>.input_scale`; llama.cpp multiplies the scale at run time, so the weight is both.
    gguf = pytest.importorskip("gguf")
    from ggufmodels import Q, _gguf_name, decoded, hf_tensors, reference, to_gguf, write_gguf

    assert gguf.GGMLQuantizationType.NVFP4 == 40
    tensors = to_gguf(arch, hf_tensors(arch))
    matrices = [n for n, v in tensors.items() if v.ndim == 2 and n.startswith("blk.")]
    # The same random blocks in both files (companions are 1-D F32: they draw nothing from the writer's seed).
    write_gguf(tmp_path / "plain.gguf", arch, tensors, Q.NVFP4)
    scales = {n: 0.25 + i / 64 for i, n in enumerate(matrices)}
    for name in matrices:
        tensors[name.removesuffix("weight") + "scale"] = np.array([scales[name]], dtype=np.float32)
        tensors[name.removesuffix("weight") + "input_scale"] = np.array([0.5], dtype=np.float32)
    write_gguf(tmp_path / "m.gguf", arch, tensors, Q.NVFP4)
    want = reference(tmp_path / "plain.gguf")  # gguf-py's decode of the blocks, transforms undone
    model, got = decoded(tmp_path / "m.gguf")
    assert got.keys() == want.keys()
    assert model.formats is not None
    assert model.formats.role_counts()["companion"] == 2 * len(matrices)
    for hf, value in want.items():
        factor = scales.get(_gguf_name(arch, hf), 1.0)
        assert torch.equal(got[hf], torch.from_numpy(np.ascontiguousarray(value)) * np.float32(factor)), hf
