"""The MoE output architectures mergekit-moe 0.1.5 writes, one frozen record each, in its candidate order.

Everything that differs between output architectures is a field of :class:`OutputKind`: which inputs it accepts,
how many shared experts it takes, which base tensors it keeps, how it lays out the experts and routers, and how
it rewrites the base's config.json. :mod:`.architectures` (the choice), :mod:`.planner` (the tensors) and
:mod:`.outconfig` (config.json) read the record and never name an architecture, so a new output architecture is
one more record in :data:`OUTPUT_KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from resumerge.runs.moe.config import MoeConfig

# Base tensors (suffixes after ``model.layers.N.``) every output keeps: mergekit takes its architecture
# template's names outside the MLPs.
ATTENTION = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
             "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def no_shared(config: MoeConfig) -> str | None:
    """Shared-expert rule of outputs without shared experts."""
    return "it has no shared experts" if config.shared_experts else None


def one_ungated_at_most(config: MoeConfig) -> str | None:
    """Shared-expert rule of outputs that take at most one shared expert, with no router row (no prompts)."""
    shared = config.shared_experts
    if len(shared) > 1:
        return "it takes at most one shared expert"
    if shared and (shared[0].positive_prompts or shared[0].negative_prompts):
        return "its shared expert cannot be gated (give it no prompts)"
    return None


def one_gated(config: MoeConfig) -> str | None:
    """Shared-expert rule of outputs that need exactly one shared expert, gated by prompts unless routers are
    random."""
    shared = config.shared_experts
    if len(shared) != 1:
        return "it needs exactly one shared expert"
    if config.gate_mode != "random" and not shared[0].positive_prompts:
        return "its shared expert needs prompts (unless gate_mode is random)"
    return None


def one_ungated(config: MoeConfig) -> str | None:
    """Shared-expert rule of outputs that need exactly one shared expert, with no router row (no prompts)."""
    if len(config.shared_experts) != 1:
        return "it needs exactly one shared expert"
    return one_ungated_at_most(config)


@dataclass(frozen=True)
class ConfigPatch:
    """How an output's config.json differs from the base's (with the base's type defaults written out).

    ``fixed`` is set over the base's values and ``defaults`` only where the base has none (both deep-copied per
    output); ``experts_key`` takes the routed expert count, ``shared_key`` (if any) the shared count or None when
    there is none, and each of ``intermediate_keys`` the base's ``intermediate_size``. ``torch_dtype`` writes the
    output dtype under ``torch_dtype`` too (remote code reads that name)."""

    architecture: str
    model_type: str
    experts_key: str
    fixed: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    defaults: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    shared_key: str | None = None
    intermediate_keys: tuple[str, ...] = ()
    torch_dtype: bool = False


@dataclass(frozen=True)
class OutputKind:
    """One MoE output architecture.

    ``name`` is mergekit-moe's, or resumerge's own for a kind mergekit-moe lacks (``architecture:`` matches it by
    case-insensitive prefix). Inputs: every model's ``model_type`` is one of ``source_types``, and all the same one
    when ``same_type``; ``shared_rule`` says why the config's shared experts do not fit (None: they do).
    ``preferred`` wins silently whenever it fits (mergekit's Mixtral rule); otherwise the first that fits does.
    Tensors: the base's ``kept`` layer suffixes (those in ``zero_filled`` are written as zeros where the base has
    none, the rest are required); experts as transformers' fused pair (``fused``) or one tensor per expert and
    part, the shared expert under ``mlp.<shared_module>``; ``shared_gate`` gives the shared expert a router of its
    own (``mlp.shared_expert_gate``); ``router_bias`` names the zero float32 bias [experts] the router adds to its
    scores (``mlp.<router_bias>``, a buffer the output's checkpoint must hold)."""

    name: str
    source_types: tuple[str, ...]
    shared_rule: Callable[[MoeConfig], str | None]
    kept: tuple[str, ...]
    fused: bool
    config: ConfigPatch
    same_type: bool = True
    preferred: bool = False
    zero_filled: tuple[str, ...] = ()
    shared_module: str | None = None
    shared_gate: bool = False
    router_bias: str | None = None

    def required(self) -> tuple[str, ...]:
        """The kept layer suffixes the base must have."""
        return tuple(s for s in self.kept if s not in self.zero_filled)


_DEEPSEEK_CODE = "deepseek-ai/deepseek-moe-16b-base--"  # remote code DeepSeek MoE outputs point at

MIXTRAL = OutputKind(
    name="Mixtral", source_types=("llama", "mistral"), shared_rule=no_shared, kept=ATTENTION, fused=True,
    preferred=True,
    config=ConfigPatch(architecture="MixtralForCausalLM", model_type="mixtral", experts_key="num_local_experts",
                       fixed=MappingProxyType({"sliding_window": None}),
                       defaults=MappingProxyType({"router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
                                                  "output_router_logits": False})))
DEEPSEEK = OutputKind(
    name="DeepSeek MoE", source_types=("llama", "mistral"), shared_rule=one_ungated_at_most, kept=ATTENTION,
    fused=False, shared_module="shared_experts",
    config=ConfigPatch(
        architecture="DeepseekForCausalLM", model_type="deepseek", experts_key="n_routed_experts",
        shared_key="n_shared_experts", intermediate_keys=("moe_intermediate_size",), torch_dtype=True,
        fixed=MappingProxyType({
            "first_k_dense_replace": 0, "moe_layer_freq": 1, "scoring_func": "softmax", "norm_topk_prob": True,
            "auto_map": {"AutoConfig": _DEEPSEEK_CODE + "configuration_deepseek.DeepseekConfig",
                         "AutoModel": _DEEPSEEK_CODE + "modeling_deepseek.DeepseekModel",
                         "AutoModelForCausalLM": _DEEPSEEK_CODE + "modeling_deepseek.DeepseekForCausalLM"}})))
QWEN2 = OutputKind(
    name="Qwen MoE", source_types=("llama", "mistral", "qwen2"), shared_rule=one_gated,
    kept=ATTENTION + QKV_BIASES, zero_filled=QKV_BIASES, fused=False, shared_module="shared_expert",
    shared_gate=True,
    config=ConfigPatch(
        architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe", experts_key="num_experts",
        intermediate_keys=("shared_expert_intermediate_size", "moe_intermediate_size"),
        fixed=MappingProxyType({"decoder_sparse_step": 1, "norm_topk_prob": True, "sliding_window": None,
                                "use_sliding_window": False, "qkv_bias": True, "mlp_only_layers": []})))
QWEN3 = OutputKind(
    name="Qwen3 MoE", source_types=("qwen3",), same_type=False, shared_rule=no_shared, kept=ATTENTION + QK_NORMS,
    fused=True,
    config=ConfigPatch(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", experts_key="num_experts",
                       intermediate_keys=("moe_intermediate_size",),
                       fixed=MappingProxyType({"decoder_sparse_step": 1, "norm_topk_prob": True}),
                       defaults=MappingProxyType({"mlp_only_layers": []})))

# Not one of mergekit-moe's: GLM-4.5's layout (sigmoid routing with a correction bias, one ungated shared expert),
# which transformers 5 loads natively. Every config it fits, DeepSeek MoE fits first: it is chosen by name only.
# Rotary over the whole head as the Llama sources (GLM's default rotates half); routing weights renormalised and
# unscaled, one group: a mixture of identical experts is that expert.
GLM4_MOE = OutputKind(
    name="GLM-4 MoE", source_types=("llama", "mistral"), shared_rule=one_ungated, kept=ATTENTION, fused=False,
    shared_module="shared_experts", router_bias="gate.e_score_correction_bias",
    config=ConfigPatch(
        architecture="Glm4MoeForCausalLM", model_type="glm4_moe", experts_key="n_routed_experts",
        shared_key="n_shared_experts", intermediate_keys=("moe_intermediate_size",),
        fixed=MappingProxyType({"first_k_dense_replace": 0, "partial_rotary_factor": 1.0, "n_group": 1,
                                "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                                "use_qk_norm": False, "num_mtp_layers": 0})))

# mergekit-moe's candidates, in its order, then resumerge's own.
OUTPUT_KINDS = (MIXTRAL, DEEPSEEK, QWEN2, QWEN3, GLM4_MOE)
