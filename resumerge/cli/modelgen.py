"""Generate tiny but real Hugging Face-style models: config.json, sharded safetensors with an index, tokenizer.

Used by ``resumerge demo``, the test suite and the benchmarks, so that nothing needs a download. The weights
are random but deterministic in ``seed``; the layout follows transformers' Llama / Qwen2 naming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from resumerge.machine.torch_import import dtype_name, torch


@dataclass(frozen=True)
class ModelSpec:
    """Shape and layout of a generated model.

    ``shard_bytes`` caps each input shard (several shards plus an index when the model is larger);
    ``arch`` is ``llama`` or ``qwen2`` (q/k/v biases and a ``layer_types`` list in config.json); ``pad`` is
    config.json's ``pad_token_id`` (left out where None), which a fine-tune may set to any id of its vocabulary.
    """

    layers: int = 4
    hidden: int = 32
    intermediate: int = 48
    vocab: int = 64
    heads: int = 4
    kv_heads: int = 2
    arch: str = "llama"
    tied: bool = False
    dtype: torch.dtype = field(default_factory=lambda: torch.float32)  # made per spec: torch loads on first use
    shard_bytes: int = 40_000
    tokenizer: bool = True
    pad: int | None = None


_DTYPE_NAMES = ("float32", "float16", "bfloat16")


def _dtype_name(dtype: torch.dtype) -> str:
    name = dtype_name(dtype)
    return name if name in _DTYPE_NAMES else "float32"


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Return every tensor name of a model of ``spec`` with its shape, in a stable order."""
    head_dim = spec.hidden // spec.heads
    kv = spec.kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, spec.hidden)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (spec.hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (spec.hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.hidden, spec.hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv, spec.hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv, spec.hidden)
        shapes[p + "self_attn.o_proj.weight"] = (spec.hidden, spec.hidden)
        if spec.arch == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (spec.hidden,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate, spec.hidden)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate, spec.hidden)
        shapes[p + "mlp.down_proj.weight"] = (spec.hidden, spec.intermediate)
    shapes["model.norm.weight"] = (spec.hidden,)
    if not spec.tied:
        shapes["lm_head.weight"] = (spec.vocab, spec.hidden)
    return shapes


def model_config(spec: ModelSpec) -> dict[str, object]:
    """Return the config.json contents transformers expects for ``spec``."""
    arch = "Qwen2ForCausalLM" if spec.arch == "qwen2" else "LlamaForCausalLM"
    config: dict[str, object] = {
        "architectures": [arch],
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": _dtype_name(spec.dtype),
    }
    if spec.pad is not None:
        config["pad_token_id"] = spec.pad
    if spec.arch == "qwen2":
        config["layer_types"] = ["full_attention"] * spec.layers
        config["use_sliding_window"] = False
    return config


def write_tokenizer(directory: Path, vocab: int, *, chat_template: str | None = None) -> None:
    """Write a small byte-level BPE tokenizer with ``vocab`` tokens (tokenizer.json and its configs)."""
    specials = ["<unk>", "<s>", "</s>"]
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    tokens = specials + alphabet
    n = 0
    while len(tokens) < vocab:  # deterministic filler pieces made of two letters
        tokens.append(alphabet[n // len(alphabet) % len(alphabet)] + alphabet[n % len(alphabet)])
        n += 1
    tokens = tokens[:vocab]
    ids = {tok: i for i, tok in enumerate(tokens)}
    merges = [f"{t[0]} {t[1]}" for t in tokens[len(specials) + len(alphabet) :]]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": ids, "merges": merges},
    }
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 128,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2)
    )


def make_model(directory: Path | str, spec: ModelSpec | None = None, *, seed: int = 0) -> Path:
    """Write a model of ``spec`` into ``directory`` (created) and return its path.

    Shards are named like transformers' (``model-00001-of-00003.safetensors`` plus
    ``model.safetensors.index.json``), or a single ``model.safetensors`` when everything fits one shard.
    Tensors are generated one at a time, so models larger than RAM can be produced. ``spec`` defaults to
    ``ModelSpec()``.
    """
    from safetensors.torch import save_file

    spec = spec or ModelSpec()

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(spec)
    element = torch.tensor([], dtype=spec.dtype).element_size()
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = element * _numel(shape)
        if groups[-1] and size + nbytes > spec.shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                t = 0.02 * torch.randn(shape, generator=gen)
            tensors[name] = t.to(spec.dtype)
            weight_map[name] = fname
            total += element * _numel(shape)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(model_config(spec), indent=2))
    if spec.tokenizer:
        write_tokenizer(out, spec.vocab)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
