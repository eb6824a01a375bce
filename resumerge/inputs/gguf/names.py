"""GGUF names and metadata as Hugging Face names and ``config.json`` (``gguf.md`` §3, §4), per family.

llama.cpp's converter renames every tensor and moves the config into ``{arch}.*`` keys; this is its inverse for the
families resumerge reads: llama (Llama, Mistral, Mixtral; q/k rows permuted), qwen2, qwen3, gemma2, gemma3 (norms
stored +1), qwen2moe and qwen3moe (experts stacked in one tensor per projection). A family or tensor it cannot map
is refused in one line, before anything is read.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from resumerge.errors import ModelInputError

if TYPE_CHECKING:
    from resumerge.machine.torch_import import torch

# general.architecture -> (architectures[0], model_type)
FAMILIES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
})
GEMMA = ("gemma2", "gemma3")

# Transforms of a decoded GGUF tensor into Hugging Face's values.
UNPERMUTE_Q = "unpermute_q"  # llama: q rows un-permuted over num_attention_heads
UNPERMUTE_K = "unpermute_k"  # ... k rows over num_key_value_heads
NORM_MINUS_ONE = "norm_minus_one"  # gemma: RMSNorm weights are stored as 1 + w

_TOP = MappingProxyType({"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"})
_BLOCK = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
})
_GEMMA_BLOCK = MappingProxyType({
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
})
# Mixtral (llama arch with experts): the block-sparse names.
_MIXTRAL_BLOCK = MappingProxyType({"ffn_gate_inp": "block_sparse_moe.gate"})
_EXPERTS = MappingProxyType({"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"})
_MIXTRAL_EXPERTS = MappingProxyType({"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"})
# Tensors the converter derives from the config (llama3's rope scaling): not weights of the HF model.
_DERIVED = ("rope_freqs.weight",)
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def family(metadata: Mapping[str, Any], where: str) -> str:
    """The file's ``general.architecture``, refused in one line when resumerge does not map it."""
    arch = metadata.get("general.architecture")
    if arch not in FAMILIES:
        raise ModelInputError(f"a GGUF of architecture {arch!r}, which resumerge cannot map to Hugging Face names "
                              f"(it reads {', '.join(FAMILIES)})", path=where,
                              hint="convert it to safetensors with transformers (gguf_file=...) and merge that")
    return str(arch)


def hf_names(arch: str, name: str, experts: int, where: str) -> list[tuple[str, int | None]]:
    """The Hugging Face names GGUF tensor ``name`` holds, each with its expert index in a stacked experts tensor
    (None for a tensor that is one HF tensor); empty for a tensor derived from the config."""
    if name in _DERIVED:
        return []
    base, _, suffix = name.rpartition(".")
    if base in _TOP and suffix == "weight":
        return [(f"{_TOP[base]}.weight", None)]
    match = _BLOCK_NAME.fullmatch(name)
    if match is not None:
        layer, part, suffix = match.groups()
        prefix = f"model.layers.{layer}."
        mixtral = arch == "llama" and experts > 0
        if part in _EXPERTS and experts > 0:
            if mixtral:
                return [(f"{prefix}block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERTS[part]}.{suffix}", e)
                        for e in range(experts)]
            return [(f"{prefix}mlp.experts.{e}.{_EXPERTS[part]}.{suffix}", e) for e in range(experts)]
        table = {**_BLOCK, **(_GEMMA_BLOCK if arch in GEMMA else {}), **(_MIXTRAL_BLOCK if mixtral else {})}
        if part in table:
            return [(f"{prefix}{table[part]}.{suffix}", None)]
    raise ModelInputError(f"GGUF tensor {name} of a {arch} model, which resumerge cannot map to a Hugging Face "
                          "name", path=where, tensor=name,
                          hint="convert it to safetensors with transformers (gguf_file=...) and merge that")


def transform(arch: str, gguf_name: str) -> str:
    """The transform from GGUF tensor ``gguf_name``'s decoded values to Hugging Face's ("" for none)."""
    if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return UNPERMUTE_Q
    if arch == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return UNPERMUTE_K
    if arch in GEMMA and gguf_name.endswith("norm.weight"):
        return NORM_MINUS_ONE
    return ""


def hf_rows(value: torch.Tensor, head_rows: int) -> torch.Tensor:
    """GGUF's q/k rows (or bias) in Hugging Face's order, whole heads of ``head_rows`` rows: GGUF row 2i of a head
    is HF row i, row 2i + 1 is HF row i + head/2 (gguf.md §3)."""
    n = value.shape[0] // head_rows
    return value.reshape(n, head_rows // 2, 2, *value.shape[1:]).transpose(1, 2).reshape(value.shape)


def gguf_rows(rows: torch.Tensor, head_rows: int) -> torch.Tensor:
    """The inverse of :func:`hf_rows`: HF row i of a head goes to GGUF row 2i, row i + head/2 to 2i + 1."""
    n = rows.shape[0] // head_rows
    return rows.reshape(n, 2, head_rows // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _named_mistral(metadata: Mapping[str, Any]) -> bool:
    """Whether the GGUF's ``general.basename`` (else ``general.name``) names a Mistral model."""
    name = metadata.get("general.basename") or metadata.get("general.name") or ""
    return isinstance(name, str) and "mistral" in name.lower()


def hf_config(arch: str, metadata: Mapping[str, Any], embed_rows: int, tied: bool) -> dict[str, Any]:
    """The ``config.json`` of the model a ``arch`` GGUF with ``metadata`` holds; ``embed_rows``: rows of its token
    embedding; ``tied``: whether it has no ``output.weight``."""

    def get(key: str, default: Any = None) -> Any:
        found = metadata.get(f"{arch}.{key}", default)
        return found.item() if hasattr(found, "item") else found

    architecture, model_type = FAMILIES[arch]
    heads = get("attention.head_count")
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": get("embedding_length"), "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length"), "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0),
        "vocab_size": embed_rows, "tie_word_embeddings": tied, "torch_dtype": "float32",
    }
    if get("attention.key_length") is not None:
        config["head_dim"] = get("attention.key_length")
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        found = metadata.get(f"tokenizer.ggml.{key}")
        if found is not None:
            config[hf] = int(found)
    if arch == "llama" and not get("expert_count") and _named_mistral(metadata):
        # llama.cpp converts MistralForCausalLM to the llama architecture (same tensors, same permutation); the
        # file's name is all that tells it apart, and a Mistral safetensors parent is compared by its class.
        config["architectures"], config["model_type"] = ["MistralForCausalLM"], "mistral"
    if get("expert_count"):
        config.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"))
        if arch == "llama":
            config["architectures"], config["model_type"] = ["MixtralForCausalLM"], "mixtral"
            config["num_local_experts"] = config.pop("num_experts")
        else:
            config["moe_intermediate_size"] = get("expert_feed_forward_length")
        if arch == "qwen3moe":
            # llama.cpp's qwen3moe always divides the chosen experts' weights by their sum; transformers'
            # Qwen3MoeConfig does so only with norm_topk_prob, false by default (Qwen3-MoE's own configs set it).
            config["norm_topk_prob"] = True
        if get("expert_shared_feed_forward_length") is not None:
            config["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    if arch in GEMMA:
        for key, hf in (("attn_logit_softcapping", "attn_logit_softcapping"),
                        ("final_logit_softcapping", "final_logit_softcapping"),
                        ("attention.sliding_window", "sliding_window"), ("rope.freq_base_swa", "rope_local_base_freq")):
            if get(key) is not None:
                config[hf] = get(key)
    return {k: v for k, v in config.items() if v is not None}


# HF model_type -> general.architecture of the GGUF llama.cpp's converter writes (Mistral's and Mixtral's as llama).
ARCH_OF: Mapping[str, str] = MappingProxyType({
    **{model_type: arch for arch, (_, model_type) in FAMILIES.items()}, "mistral": "llama", "mixtral": "llama",
})
MOE_ARCHS = ("qwen2moe", "qwen3moe")
_TOP_BACK = MappingProxyType({hf: gguf for gguf, hf in _TOP.items()})
# A routed expert's projection stored one tensor per expert (Qwen-MoE's names, Mixtral's w1/w3/w2), or transformers
# 5's fused stack of a layer's experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_FUSED_STACK = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?")
_EXPERT_BACK = MappingProxyType({
    **{hf: gguf for gguf, hf in _EXPERTS.items()}, **{hf: gguf for gguf, hf in _MIXTRAL_EXPERTS.items()},
})


def expert_target(hf: str) -> tuple[tuple[str, ...], int | None] | None:
    """The stacked GGUF tensors HF tensor ``hf`` is written into: a per-expert projection's stack and its expert
    index (``blk.N.ffn_gate_exps.weight``, e), or a fused stack's GGUF tensors with None (``gate_up_proj``: gate's,
    then up's; ``down_proj``: down's); None for a tensor that is not a routed expert's."""
    match = _PER_EXPERT.fullmatch(hf)
    if match is not None and match.group(3) in _EXPERT_BACK:
        layer, expert, part = match.groups()
        return (f"blk.{layer}.{_EXPERT_BACK[part]}.weight",), int(expert)
    match = _FUSED_STACK.fullmatch(hf)
    if match is not None:
        layer, stack = match.groups()
        parts = ("ffn_gate_exps", "ffn_up_exps") if stack == "gate_up_proj" else ("ffn_down_exps",)
        return tuple(f"blk.{layer}.{part}.weight" for part in parts), None
    return None


def gguf_name(arch: str, hf: str, *, experts: bool = False) -> str | None:
    """The GGUF name of HF tensor ``hf`` of an ``arch`` model (``experts``: a mixture of experts, whose routers it
    names); None for one the family's GGUF does not hold (gemma2's tied ``lm_head``). A routed expert's projection
    is :func:`expert_target`'s."""
    base, _, suffix = hf.rpartition(".")
    if base in _TOP_BACK and suffix == "weight":
        return None if arch == "gemma2" and base == "lm_head" else f"{_TOP_BACK[base]}.weight"
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    if match is not None:
        layer, part, suffix = match.groups()
        table = {**_BLOCK, **(_GEMMA_BLOCK if arch in GEMMA else {})}
        back = {v: k for k, v in table.items()}
        if experts and part == "block_sparse_moe.gate":  # Mixtral's router, under transformers 4's name
            part = "mlp.gate"
        routing = part == "mlp.gate" or part.startswith("mlp.shared_expert")
        if part in back and (not routing or (experts and (part == "mlp.gate" or arch == "qwen2moe"))):
            return f"blk.{layer}.{back[part]}.{suffix}"
    raise ModelInputError(f"{hf} of a {arch} model has no GGUF name resumerge knows", tensor=hf,
                          hint="write the merge as safetensors")


def gguf_metadata(arch: str, config: Mapping[str, Any]) -> list[tuple[str, tuple[str, Any]]]:
    """The ``{arch}.*`` hyperparameter keys llama.cpp's converter writes for HF ``config`` (``gguf.md`` §4), as
    (key, (kind, value)) with kind ``u32`` or ``f32``, in the converter's order."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    keys: list[tuple[str, tuple[str, Any]]] = [
        ("block_count", ("u32", config["num_hidden_layers"])),
        ("context_length", ("u32", config.get("max_position_embeddings", 4096))),
        ("embedding_length", ("u32", config["hidden_size"])),
        ("feed_forward_length", ("u32", config["intermediate_size"])),
        ("attention.head_count", ("u32", heads)),
        ("attention.head_count_kv", ("u32", config.get("num_key_value_heads") or heads)),
        ("rope.freq_base", ("f32", _rope_theta(arch, config))),
        ("attention.layer_norm_rms_epsilon", ("f32", config.get("rms_norm_eps", 1e-6))),
        ("attention.key_length", ("u32", head_dim)),
        ("attention.value_length", ("u32", head_dim)),
    ]
    if arch == "llama":
        keys += [("rope.dimension_count", ("u32", head_dim)), ("vocab_size", ("u32", config["vocab_size"]))]
    if arch in GEMMA:
        for key, hf, kind in (("attn_logit_softcapping", "attn_logit_softcapping", "f32"),
                              ("final_logit_softcapping", "final_logit_softcapping", "f32"),
                              ("attention.sliding_window", "sliding_window", "u32"),
                              ("rope.freq_base_swa", "rope_local_base_freq", "f32")):
            if config.get(hf) is not None:
                keys.append((key, (kind, config[hf])))
    keys += _expert_keys(arch, config)
    return [(f"{arch}.{key}", value) for key, value in keys]


# Whether llama.cpp's graph of a mixture-of-experts family divides the chosen experts' routing weights by their sum:
# hard-coded in its call of build_moe_ffn, read from no GGUF key (nor are expert_weights_scale and
# expert_gating_func for these families: softmax, unscaled, as transformers'). Mixtral always renormalises, in
# transformers and llama.cpp alike; Qwen-MoE does in transformers only with norm_topk_prob (false when absent).
_RENORMALISED = MappingProxyType({"qwen2moe": False, "qwen3moe": True})


def expert_count(config: Mapping[str, Any]) -> Any:
    """A mixture of experts' routed expert count as config.json says it (``num_experts``, Mixtral's
    ``num_local_experts``); None (or 0) for a dense model."""
    return config.get("num_experts") or config.get("num_local_experts")


def check_routing(arch: str, config: Mapping[str, Any], dense_layers: Collection[int]) -> None:
    """Refuse (exit 2, at plan time) a mixture of experts whose ``config`` routes tokens otherwise than llama.cpp's
    ``arch`` graph does, which no GGUF key can say: Qwen-MoE's ``norm_topk_prob`` against the family's hard-coded
    renormalisation (moot when every expert is chosen: softmax weights over all of them already sum to 1), and a
    dense layer among the experts (``dense_layers``, as the planner reads them from ``decoder_sparse_step`` and
    ``mlp_only_layers``: :func:`resumerge.merge.plan.architecture.dense_mlp_layers`), which llama.cpp's Qwen-MoE
    graphs do not have."""
    if arch not in _RENORMALISED:
        return
    count = expert_count(config)
    if not count:
        return
    renormalised = _RENORMALISED[arch]
    chosen = config.get("num_experts_per_tok")
    normalises = bool(config.get("norm_topk_prob", False))
    if normalises != renormalised and chosen is not None and chosen < count:
        said = (f"says norm_topk_prob: {'true' if normalises else 'false'}" if "norm_topk_prob" in config
                else "has no norm_topk_prob (transformers reads false)")
        does = "always divides" if renormalised else "never divides"
        raise ModelInputError(
            f"the output's config.json {said}, and llama.cpp's {arch} {does} the {chosen} chosen experts' routing "
            f"weights (of {count}) by their sum, whatever the GGUF says: the file would compute another model than "
            "the merge",
            hint="write it as safetensors (--out-type safetensors)" + (
                ", or, if the model was trained with renormalised weights (Qwen3-MoE's own were), set "
                "norm_topk_prob: true in its config.json" if renormalised else ""))
    dense = sorted(dense_layers)
    if dense:
        step = config.get("decoder_sparse_step") or 1
        raise ModelInputError(
            f"the output's config.json makes layer{'s' if len(dense) > 1 else ''} "
            f"{', '.join(map(str, dense))} dense (decoder_sparse_step {step}, mlp_only_layers "
            f"{list(config.get('mlp_only_layers') or [])}), and llama.cpp's {arch} has experts in every layer: it "
            "would not load the file", hint="write it as safetensors (--out-type safetensors)")


def _expert_keys(arch: str, config: Mapping[str, Any]) -> list[tuple[str, tuple[str, Any]]]:
    """The mixture-of-experts keys llama.cpp's converter writes (``gguf.md`` §4): the routed expert count
    (``num_experts``, Mixtral's ``num_local_experts``) and how many route each token; Qwen-MoE's expert width and
    shared expert width. None for a dense model."""
    count = expert_count(config)
    if not count:
        return []
    keys: list[tuple[str, tuple[str, Any]]] = [("expert_count", ("u32", count)),
                                               ("expert_used_count", ("u32", config["num_experts_per_tok"]))]
    if arch in MOE_ARCHS and config.get("moe_intermediate_size") is not None:
        keys.append(("expert_feed_forward_length", ("u32", config["moe_intermediate_size"])))
    if arch == "qwen2moe" and config.get("shared_expert_intermediate_size") is not None:
        keys.append(("expert_shared_feed_forward_length", ("u32", config["shared_expert_intermediate_size"])))
    return keys


def _rope_theta(arch: str, config: Mapping[str, Any]) -> float:
    theta = config.get("rope_theta")
    if theta is None and isinstance(config.get("rope_parameters"), Mapping):
        theta = config["rope_parameters"].get("rope_theta")
    return float(theta if theta is not None else 1e6 if arch == "gemma3" else 10000.0)
