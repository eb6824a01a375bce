"""The forward engine's native modules (:mod:`resumerge.forward.engine.native`) against transformers' modules of the
same checkpoint: every decoder layer's output and the logits are the same to the bit, in float32 and bfloat16, for a
padded batch and for sequences alone, with sliding windows reached, biases, tied and untied heads and each RoPE
scaling they build, and Gemma's ways (its norms, embedding scale, eager soft-capped attention, local and global
rotary embeddings, soft-capped logits); a config.json that leaves its keys out is read with transformers'
defaults; whatever they do not build goes to transformers; and a resumed check of such a model does not import
transformers at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import cli

from resumerge.config.modelref import ModelRef
from resumerge.forward.engine.built import build_modules
from resumerge.forward.engine.native import NativeConfig, read_config
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.inputs.model import open_model
from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

_SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16, "rope_theta": 500000.0}
# name: (model_type, config, config.json keys replaced after saving)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("llama", {}, {}),
    # a pad id above every row the batches use (Llama-3 fine-tunes set 128004, Qwen 151643): the pass's embedding
    # of the used rows alone must not keep it, and gives the whole table's rows
    "llama_pad_above": ("llama", {"pad_token_id": 120}, {}),
    "llama_biased_llama3": ("llama", {"attention_bias": True, "mlp_bias": True, "rope_parameters": _LLAMA3}, {}),
    # the older keys: rope_scaling and rope_theta beside it, as Llama 3.1's config.json has them
    "llama_legacy_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                      "tie_word_embeddings": True},
                            {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0},
                             "rope_theta": 1e4}),
    "mistral_window": ("mistral", {"sliding_window": 4}, {}),
    "qwen2_window": ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 5,
                               "max_window_layers": 1}, {"layer_types": None}),
    "qwen3": ("qwen3", {"head_dim": 8, "num_key_value_heads": 4}, {}),
    "qwen3_grouped": ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}, {}),
    # Gemma: head_dim other than hidden / heads, the legacy hidden_act "gelu" (read as the tanh approximation)
    "gemma": ("gemma", {"head_dim": 16}, {"hidden_act": "gelu"}),
    # Gemma 2: eager attention, a window the 20-token sequence reaches, caps small enough to bite, the layers'
    # types left to the default alternation
    "gemma2_window": ("gemma2", {"head_dim": 8, "sliding_window": 5, "query_pre_attn_scalar": 12,
                                 "attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0},
                      {"layer_types": None}),
    "gemma2_pad_above": ("gemma2", {"head_dim": 8, "pad_token_id": 120}, {}),
    "gemma2_uncapped": ("gemma2", {"head_dim": 16, "num_key_value_heads": 4, "attn_logit_softcapping": None,
                                   "final_logit_softcapping": None, "tie_word_embeddings": False}, {}),
    # Gemma 3's text model as tests/families.py saves it: the legacy sliding_window_pattern, rope_theta,
    # rope_local_base_freq and rope_scaling (the global layers' linear scaling) instead of layer_types and
    # rope_parameters
    "gemma3_pattern": ("gemma3_text", {"head_dim": 8, "sliding_window": 5},
                       {"layer_types": None, "sliding_window_pattern": 2, "rope_parameters": None,
                        "rope_theta": 50000.0, "rope_local_base_freq": 300.0,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    # Phi-3 (and Phi-4: model_type phi3): fused qkv_proj and gate_up_proj sliced as transformers slices them, a
    # window the 20-token sequence reaches (Phi-3-mini's config has one), and without a window, untied
    "phi3_window": ("phi3", {"sliding_window": 6, "pad_token_id": 0}, {}),
    "phi3_grouped": ("phi3", {"num_key_value_heads": 1, "pad_token_id": 0, "tie_word_embeddings": True,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}}, {}),
    "gemma3_layer_types": ("gemma3_text", {"head_dim": 16, "num_key_value_heads": 1, "sliding_window": 6,
                                           "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                                           "final_logit_softcapping": 3.0, "attn_logit_softcapping": 0.5,
                                           "query_pre_attn_scalar": 20}, {}),
}
TOKENS = [[1, 5, 9, 33, 70, 2, 11, 100, 4, 6, 7, 8, 12, 13, 99, 98, 97, 3, 40, 41], [1, 44, 3, 90, 17, 18],
          [7, 8]]


def _saved(directory: Path, model_type: str, config: dict[str, Any], replace: dict[str, Any]) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**_SIZES, **config}))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))  # norms and biases differ too
    model.save_pretrained(directory, safe_serialization=True)
    path = directory / "config.json"
    doc = json.loads(path.read_text())
    for key, value in replace.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    path.write_text(json.dumps(doc))
    return directory


def _stream(directory: Path, dtype: torch.dtype, native: bool) -> ModelStream:
    opened = open_model(ModelRef(str(directory)), directory=directory)
    built = build_modules(directory, dtype, what="test", native=native)
    assert isinstance(built[0], NativeConfig) == native
    return ModelStream(Weights.of(opened.directory, opened.tensors), opened.config, dtype, what="test", built=built)


def _run(stream: ModelStream, batch: list[list[int]]) -> list[torch.Tensor]:
    """Every decoder layer's output and the logits, for the sequences of ``batch`` padded on the right."""
    longest = max(map(len, batch))
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in batch])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in batch])
    found = []
    with torch.no_grad():
        ((hidden, calls),) = stream.inputs([(ids, mask)])
        ((rows_hidden, _),) = stream.inputs_of_rows([(ids, mask)])  # the check's way: the used rows only
        assert torch.equal(rows_hidden, hidden)
        found.append(hidden)
        for index, layer in enumerate(stream.layers_list):
            with stream.loaded(layer) as loaded:
                hidden = stream.run(loaded, hidden, calls[index])
            found.append(hidden)
        with stream.head() as head:
            found.append(head(hidden))
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_layers_and_logits_equal_transformers_to_the_bit(tmp_path: Path, name: str) -> None:
    directory = _saved(tmp_path / name, *CASES[name])
    for dtype in (torch.float32, torch.bfloat16):
        native, theirs = _stream(directory, dtype, True), _stream(directory, dtype, False)
        with native, theirs:
            for batch in (TOKENS, *([s] for s in TOKENS)):
                for step, (mine, expected) in enumerate(zip(_run(native, batch), _run(theirs, batch), strict=True)):
                    assert mine.dtype == expected.dtype
                    assert torch.equal(mine, expected), (name, dtype, len(batch), step,
                                                         float((mine.float() - expected.float()).abs().max()))


def _transformers_windows(config: Any) -> list[int | None]:
    types = getattr(config, "layer_types", None)
    if types is None:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("doc", [
    {"model_type": "llama"},
    {"model_type": "mistral"},
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "qwen2"},
    {"model_type": "qwen2", "use_sliding_window": True, "num_hidden_layers": 30},
    {"model_type": "qwen3"},
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "rope_theta": 500000.0, "max_position_embeddings": 131072},
    {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0}, "original_max_position_embeddings": 4096},
    # Phi-3's and Phi-4's (its default pad_token_id, 32000, is past these tests' small vocabulary)
    {"model_type": "phi3", "pad_token_id": 0},
    {"model_type": "phi3", "pad_token_id": 0, "num_key_value_heads": 4, "sliding_window": 2047, "rope_scaling": None,
     "rope_theta": 250000, "partial_rotary_factor": 1.0},
    {"model_type": "gemma"},
    {"model_type": "gemma", "hidden_act": "gelu", "rope_theta": 20000.0},
    {"model_type": "gemma2"},
    {"model_type": "gemma2", "num_hidden_layers": 5, "final_logit_softcapping": None, "sliding_window": 2},
    # the keys of Gemma 2 9B's and Gemma 3 1B's config.json (transformers 4's)
    {"model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
     "cache_implementation": "hybrid", "query_pre_attn_scalar": 144, "sliding_window_size": 4096},
    {"model_type": "gemma3_text", "num_hidden_layers": 8, "rope_scaling": None, "rope_local_base_freq": 10000,
     "rope_theta": 1000000, "sliding_window_pattern": 6, "sliding_window": 512, "final_logit_softcapping": None,
     "attn_logit_softcapping": None, "query_pre_attn_scalar": 256},
    {"model_type": "gemma3_text", "num_hidden_layers": 8},
    {"model_type": "gemma3_text", "sliding_window_pattern": 3, "num_hidden_layers": 7, "rope_theta": 500000.0,
     "rope_local_base_freq": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    {"model_type": "gemma3_text", "layer_types": ["full_attention", "sliding_attention"],
     "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    {"model_type": "gemma3_text", "layer_types": ["full_attention", "full_attention"],
     "rope_parameters": {"full_attention": {"rope_type": "default"}}},
])
def test_a_config_json_is_read_with_transformers_defaults(tmp_path: Path, doc: dict[str, Any]) -> None:
    """The modules built from a config.json leaving keys out have transformers' shapes, biases, norms, windows and
    rotary frequencies (sizes kept small: the defaults are 4096 wide)."""
    small = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps({**small, **doc}))
    config, model = build_modules(tmp_path, torch.float32, what="test")
    their_config, theirs = build_modules(tmp_path, torch.float32, what="test", native=False)
    assert isinstance(config, NativeConfig)
    assert ({n: tuple(p.shape) for n, p in model.named_parameters()}
            == {n: tuple(p.shape) for n, p in theirs.named_parameters()})
    if config.local_rope is None:
        assert torch.equal(model.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    else:  # Gemma 3: the global (full attention) and local (sliding) frequencies, where a layer uses them
        types = set(their_config.layer_types)
        for kind, mine in (("full_attention", model.model.rotary_emb), ("sliding_attention",
                                                                         model.model.local_rotary_emb)):
            if kind in types:
                assert torch.equal(mine.inv_freq, getattr(theirs.model.rotary_emb, f"{kind}_inv_freq")), kind
    assert list(config.windows) == _transformers_windows(their_config)
    assert config.rms_norm_eps == their_config.rms_norm_eps
    if config.model_type.startswith("gemma"):
        assert torch.equal(model.model.embed_tokens.embed_scale, theirs.model.embed_tokens.embed_scale)
        assert config.final_logit_softcapping == getattr(their_config, "final_logit_softcapping", None)
        assert config.query_pre_attn_scalar == getattr(their_config, "query_pre_attn_scalar", None)
        assert getattr(their_config, "hidden_activation", None) in (None, config.hidden_act)
        assert getattr(their_config, "hidden_act", config.hidden_act) == config.hidden_act
        assert their_config._attn_implementation == ("eager" if config.eager_attention else "sdpa")
        if config.eager_attention:
            assert config.attn_logit_softcapping == their_config.attn_logit_softcapping
    assert config.tie_word_embeddings == bool(their_config.tie_word_embeddings)
    assert config.num_hidden_layers == their_config.num_hidden_layers


@pytest.mark.parametrize("doc", [
    {"model_type": "gemma3"},  # the multimodal model
    {"model_type": "gemma2", "hidden_activation": "gelu"},
    {"model_type": "gemma", "hidden_act": "silu"},
    {"model_type": "gemma", "head_dim": None},
    {"model_type": "gemma2", "sliding_window": None},  # sliding layers, without a window
    {"model_type": "gemma2", "rope_parameters": {"full_attention": {"rope_type": "default"}}},
    {"model_type": "gemma3_text", "use_bidirectional_attention": True},
    {"model_type": "gemma3_text", "rope_scaling": {"rope_type": "yarn", "factor": 8.0}},
    {"model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 3},  # 26 layers
    {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"model_type": "llama", "hidden_act": "gelu"},
    {"model_type": "llama", "partial_rotary_factor": 0.5},
    {"model_type": "qwen2", "layer_types": ["sliding_attention"] * 32},  # sliding, without a window
    {"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
    {"model_type": "phi3", "partial_rotary_factor": 0.75},  # Phi-4-mini
    {"model_type": "phi3", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},  # Phi-3 takes longrope only
    {"model_type": "mistral", "layer_types": ["full_attention"] * 32},
    {"model_type": "llama", "num_attention_heads": "32"},
])
def test_what_the_native_modules_do_not_build_is_left_to_transformers(doc: dict[str, Any]) -> None:
    assert read_config(doc) is None


@pytest.mark.parametrize("change", ["no head", "transposed"])
def test_a_checkpoint_laid_out_otherwise_is_read_through_transformers(tmp_path: Path, change: str) -> None:
    """Untied without a head of its own, or a weight stored in another shape: the native modules would not find
    what they read, so the stream is built by transformers (whose conversion then reads it, or says what is
    missing, as before)."""
    from safetensors.torch import load_file, save_file

    directory = _saved(tmp_path / "m", "llama", {}, {})
    tensors = load_file(str(directory / "model.safetensors"))
    if change == "no head":
        del tensors["lm_head.weight"]
    else:
        name = "model.layers.1.mlp.down_proj.weight"
        tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    opened = open_model(ModelRef(str(directory)), directory=directory)
    assert isinstance(build_modules(directory, torch.float32, what="test")[0], NativeConfig)
    with ModelStream(Weights.of(opened.directory, opened.tensors), opened.config, torch.float32, what="test") as s:
        assert not isinstance(s.config, NativeConfig)


def test_a_resumed_check_of_a_native_family_never_imports_transformers(tmp_path: Path) -> None:
    """The start a resumed check pays again: with its tokens kept and its modules native, transformers (2.5 s of a
    fresh process's start) is not imported; the report equals an uninterrupted check's."""
    from resumerge import api

    merge = _saved(tmp_path / "merge", *CASES["llama"])
    parent = _saved(tmp_path / "parent", "llama", {"attention_bias": False}, {"rope_theta": 20000.0})
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(merge / "tokenizer.json"))
    (merge / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    texts = tmp_path / "texts.txt"
    texts.write_text("w1 w5 w9 w33 w70 w2 w11\nw4 w6 w7 w8 w12\n")
    state = tmp_path / "state"
    killed = cli("check", merge, "--parent", parent, "--prompts", texts, "--state-dir", state,
                 env={"RESUMERGE_KILL_AT": "after_check_layer:2"}, timeout=300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert killed.returncode == -9, killed.stderr[-2000:]
    code = ("import json, sys\nfrom resumerge import api\n"
            f"report = api.check({str(merge)!r}, parents=[{str(parent)!r}], prompts={str(texts)!r}, "
            f"settings=api.Settings(state_dir={str(state)!r}))\n"
            "print(json.dumps({'transformers': 'transformers' in sys.modules, 'report': report.to_json()}))")
    resumed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    found = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert found["transformers"] is False
    whole = api.check(merge, parents=[parent], prompts=texts,
                      settings=api.Settings(state_dir=tmp_path / "whole")).to_json()
    found["report"].pop("chart"), whole.pop("chart")
    assert found["report"] == json.loads(json.dumps(whole))
