"""open_adapter: targets, ranks and scales as PEFT computes them, factor locations, replacements, tokenizer, digest."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora.conftest import LLAMA_LINEAR, Case
from lora.gen import make_adapter, read_source
from resumerge.inputs.adapters import open_adapter
from resumerge.inputs.adapters.settings import LoraSettings
from resumerge.inputs.files import file_identity
from resumerge.inputs.safetensors_format import read_header
from resumerge.inputs.tensorio import TensorReader

CHAT = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def test_llama_targets_ranks_scales_and_replacements(lora_case: Callable[[str], Case]) -> None:
    case = lora_case("llama-f32")
    adapter = open_adapter(case.adapter, yaml_path="models[0]")
    layers = {f"model.layers.{i}.{'self_attn' if m.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}"
              f".{m}.weight" for i in range(4) for m in LLAMA_LINEAR}
    assert set(adapter.targets) == layers | {"model.embed_tokens.weight"}
    # lm_head in modules_to_save; the embedding's own matrix, saved beside its LoRA (PEFT save_embedding_layers).
    assert set(adapter.replacements) == {"lm_head.weight", "model.embed_tokens.weight"}
    expected = {  # r=4, alpha=8 unless a pattern says otherwise; scale = alpha / r
        "model.layers.1.self_attn.q_proj.weight": (2, 8, 4.0),
        "model.layers.2.mlp.down_proj.weight": (6, 8, 8 / 6),
        "model.layers.3.mlp.down_proj.weight": (6, 8, 8 / 6),
        "model.layers.0.mlp.down_proj.weight": (4, 8, 2.0),
        "model.layers.0.self_attn.v_proj.weight": (4, 3, 0.75),
        "model.layers.0.mlp.up_proj.weight": (4, 20, 5.0),
        "model.layers.1.mlp.up_proj.weight": (4, 8, 2.0),
    }
    for name, (rank, alpha, scale) in expected.items():
        t = adapter.targets[name]
        assert (t.rank, t.alpha, t.scale) == (rank, alpha, scale), name
        assert not t.fan_in_fan_out and not t.embedding
    emb = adapter.targets["model.embed_tokens.weight"]
    assert emb.embedding and emb.fan_in_fan_out and emb.weight_shape == (64, 32)
    assert adapter.targets["model.layers.0.self_attn.k_proj.weight"].weight_shape == (16, 32)
    assert adapter.targets["model.layers.0.mlp.down_proj.weight"].weight_shape == (32, 48)
    # Each recorded byte range holds exactly the tensor safetensors reads under that name.
    stored = load_file(str(case.adapter / "adapter_model.safetensors"))
    reader = TensorReader()
    try:
        for t in adapter.targets.values():
            for source in (t.a, t.b):
                assert torch.equal(read_source(reader, adapter.directory, source), stored[source.entry.name])
        for source in adapter.replacements.values():
            assert torch.equal(read_source(reader, adapter.directory, source), stored[source.entry.name])
    finally:
        reader.close()
    weights = case.adapter / "adapter_model.safetensors"
    (info,) = adapter.files
    assert (info.name, info.size) == ("adapter_model.safetensors", weights.stat().st_size)
    assert info.identity == file_identity(weights, read_header(weights).raw)
    assert adapter.config["peft_type"] == "LORA" and adapter.directory == case.adapter


def test_rslora_scale_and_gpt2_conv1d_fan_in_fan_out(lora_case: Callable[[str], Case]) -> None:
    rslora = open_adapter(lora_case("llama-bf16-rslora").adapter, yaml_path="")
    assert {t.scale for t in rslora.targets.values()} == {16 / math.sqrt(8)}
    assert {rslora.targets[n].a.entry.dtype for n in rslora.targets} == {"BF16"}
    gpt2 = open_adapter(lora_case("gpt2-f32-bias").adapter, yaml_path="")
    assert all(t.fan_in_fan_out and not t.embedding for t in gpt2.targets.values())
    assert gpt2.targets["transformer.h.0.attn.c_attn.weight"].weight_shape == (32, 96)  # Conv1D: (in, out)
    assert gpt2.targets["transformer.h.1.mlp.c_proj.weight"].weight_shape == (128, 32)
    # bias: all — adapted modules' biases come as <module>.base_layer.bias, the others under their own names.
    assert "transformer.h.0.attn.c_attn.bias" in gpt2.replacements
    assert gpt2.replacements["transformer.h.0.attn.c_attn.bias"].entry.name.endswith("c_attn.base_layer.bias")
    assert {"transformer.h.1.ln_2.bias", "transformer.ln_f.bias"} <= set(gpt2.replacements)
    assert not any(name.endswith(".weight") for name in gpt2.replacements)


MODULES = [
    "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.12.self_attn.q_proj",
    "model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj", "model.embed_tokens", "lm_head",
    "model.layers.1.self_attn.xq_proj",
]
PATTERNS = [
    {},
    {"q_proj": 3},
    {"layers.1.self_attn.q_proj": 5, "q_proj": 3},
    {"q_proj": 3, "layers.1.self_attn.q_proj": 5},
    {r"layers\.[12]\.mlp\.down_proj": 7, "model.embed_tokens": 2},
    {"layers.1": 9, "proj": 11},
    {"model.layers.1.self_attn.q_proj": 13},
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_rank_and_alpha_patterns_follow_peft_key_matching(pattern: dict[str, int]) -> None:
    from peft.utils.other import get_pattern_key

    settings = LoraSettings(r=4, lora_alpha=8, use_rslora=False, fan_in_fan_out=False,
                            rank_pattern=tuple(pattern.items()),
                            alpha_pattern=tuple((k, v * 10.0) for k, v in pattern.items()))
    for module in MODULES:
        rank, alpha = settings.rank_and_alpha(module)
        key = get_pattern_key(list(pattern), module)
        assert rank == pattern.get(key, 4), (pattern, module)
        assert alpha == pattern.get(key, 0.8) * 10.0, (pattern, module)


def test_tokenizer_files_and_digest(tmp_path: Path, llama_base: Path) -> None:
    plain = tmp_path / "plain"
    make_adapter(llama_base, plain, r=2, alpha=4, targets=["q_proj"])
    bare = open_adapter(plain, yaml_path="")
    assert bare.tokenizer_files == () and not bare.has_tokenizer
    with_tok = tmp_path / "with_tok"
    shutil.copytree(plain, with_tok)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(llama_base / name, with_tok / name)
    doc = json.loads((with_tok / "tokenizer_config.json").read_text())
    (with_tok / "tokenizer_config.json").write_text(json.dumps({**doc, "chat_template": CHAT}))
    tok = open_adapter(with_tok, yaml_path="")
    assert tok.tokenizer_files == ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")
    assert tok.has_tokenizer
    assert json.loads((tok.directory / "tokenizer_config.json").read_text())["chat_template"] == CHAT
    assert tok.targets.keys() == bare.targets.keys() and tok.digest != bare.digest
    assert open_adapter(with_tok, yaml_path="").digest == tok.digest  # stable when nothing changed
    # A chat template alone is listed, but is not a tokenizer.
    template_only = tmp_path / "template_only"
    make_adapter(llama_base, template_only, r=2, alpha=4, targets=["q_proj"], chat_template=CHAT)
    assert open_adapter(template_only, yaml_path="").tokenizer_files == ("chat_template.jinja",)
    assert not open_adapter(template_only, yaml_path="").has_tokenizer
    # Any change to what the merge reads from the adapter changes the digest.
    digests = {tok.digest}
    (with_tok / "tokenizer.json").write_text((with_tok / "tokenizer.json").read_text() + " ")
    digests.add(open_adapter(with_tok, yaml_path="").digest)
    config = json.loads((with_tok / "adapter_config.json").read_text())
    (with_tok / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 5}))
    changed = open_adapter(with_tok, yaml_path="")
    assert {t.scale for t in changed.targets.values()} == {2.5}
    digests.add(changed.digest)
    tensors = load_file(str(with_tok / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1
    save_file(tensors, str(with_tok / "adapter_model.safetensors"), metadata={"format": "pt"})
    digests.add(open_adapter(with_tok, yaml_path="").digest)
    assert len(digests) == 4


def test_make_adapter_copies_a_tokenizer_with_its_chat_template(tmp_path: Path, llama_base: Path) -> None:
    adapter_dir = tmp_path / "a"
    make_adapter(llama_base, adapter_dir, r=2, alpha=4, targets=["v_proj"], seed=9, tokenizer_from=llama_base,
                 chat_template=CHAT)
    adapter = open_adapter(Path(os.path.relpath(adapter_dir)), yaml_path="")
    assert adapter.directory.is_absolute() and adapter.directory.resolve() == adapter_dir.resolve()
    assert adapter.has_tokenizer
    assert json.loads((adapter_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT
    assert (adapter_dir / "tokenizer.json").read_bytes() == (llama_base / "tokenizer.json").read_bytes()
    assert set(adapter.targets) == {f"model.layers.{i}.self_attn.v_proj.weight" for i in range(4)}
