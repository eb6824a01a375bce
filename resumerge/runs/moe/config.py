"""The mergekit-moe config: schema and every check that needs only the YAML (mergekit-moe 0.1.5's
``is_bad_config`` plus what it leaves to crash), each a :class:`~resumerge.errors.ConfigError` with the YAML path.

A config is a mergekit-moe one when its top level has ``experts`` and no ``merge_method``
(:func:`is_moe_text`), the way a multi-document text is a recipe. Unknown keys are refused, as everywhere else
(mergekit ignores them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resumerge.config.merge_config import MergeConfig, SourceConfig, check_dtype, near_key, parse_documents
from resumerge.config.modelref import ModelRef, parse_model_ref
from resumerge.config.yamltext import anchor_holders
from resumerge.errors import ConfigError
from resumerge.merge.plan.cardwording import CardWording

# What the output's model card says of an upcycled MoE, as a merge method's declaration says it of the method:
# (display name, one-line description, link; none when empty). The kinds' card hook reads it.
CARD_METHOD = ("Mixture of Experts", "a mixture of experts upcycled from dense models (mergekit-moe): the base "
               "model's attention and embeddings, each expert's MLPs, and routers chosen by gate_mode.", "")
# A mixture of experts' card says what the run was, not a merge's words.
CARD_WORDING = CardWording(
    title="Mixture of experts",
    lead=("A mixture of experts upcycled from dense language models, made with resumerge from a "
          "[mergekit-moe](https://github.com/arcee-ai/mergekit) configuration."),
    tags=("moe",),
)
GATE_MODES = ("hidden", "hidden_avg", "hidden_last", "cheap_embed", "random", "uniform_random")
# Gate modes whose routers come from the prompts (they need transformers for the tokenizer).
PROMPT_MODES = frozenset({"hidden", "hidden_avg", "hidden_last", "cheap_embed"})
TOP_LEVEL_KEYS = frozenset(
    {"base_model", "experts", "gate_mode", "dtype", "experts_per_token", "shared_experts", "architecture"}
)
EXPERT_KEYS = frozenset({"source_model", "positive_prompts", "negative_prompts", "noise_scale", "residual_scale"})


@dataclass(frozen=True)
class ExpertConfig:
    """One routed or shared expert: the model whose MLPs it is, its prompts, noise and down_proj scale."""

    model: ModelRef
    positive_prompts: tuple[str, ...] | None
    negative_prompts: tuple[str, ...] | None
    noise_scale: float | None
    residual_scale: float | None
    yaml_path: str


@dataclass(frozen=True)
class MoeConfig:
    """A validated mergekit-moe config; ``text`` is the YAML as given (written to mergekit_moe_config.yml)."""

    text: str
    base_model: ModelRef
    experts: tuple[ExpertConfig, ...]
    gate_mode: str
    dtype: str | None
    experts_per_token: int
    shared_experts: tuple[ExpertConfig, ...]
    architecture: str | None

    def referenced_models(self) -> list[tuple[ModelRef, str]]:
        """Every model the config names with where it first appears, deduplicated, the base first."""
        seen: set[str] = set()
        out = []
        for ref, where in [(self.base_model, "base_model")] + [
            (e.model, f"{e.yaml_path}.source_model") for e in (*self.experts, *self.shared_experts)
        ]:
            if ref.key not in seen:
                seen.add(ref.key)
                out.append((ref, where))
        return out

    def as_merge_config(self) -> MergeConfig:
        """The models of this config as a ``models:`` merge config names them (for the model catalog, which
        opens them, and the model card, which lists them)."""
        sources = tuple(SourceConfig(ref, None, {}, where.removesuffix(".source_model"))
                        for ref, where in self.referenced_models()[1:])
        return MergeConfig(text=self.text, merge_method="moe", models=sources, slices=None,
                           base_model=self.base_model, parameters={}, dtype=None, out_dtype=None,
                           tokenizer_source=None, tokenizer=None, chat_template=None)

    @property
    def gated(self) -> tuple[ExpertConfig, ...]:
        """The experts that get a router row, in mergekit's order: the routed ones, then the shared ones when they
        have prompts or the gates are random (mergekit draws their rows too, which decides the random draws)."""
        if self.shared_experts and (self.shared_experts[0].positive_prompts
                                    or self.gate_mode in ("random", "uniform_random")):
            return (*self.experts, *self.shared_experts)
        return self.experts


def prompt_texts(config: MoeConfig) -> list[tuple[list[str], list[str] | None]]:
    """Each gated expert's (positive, negative or None) prompts."""
    return [(list(e.positive_prompts or ()), list(e.negative_prompts) if e.negative_prompts else None)
            for e in config.gated]


def is_moe_text(text: str) -> bool:
    """True when ``text`` is one YAML mapping with an ``experts`` key and no ``merge_method`` (text that is not
    valid YAML, or repeats a key, counts as not MoE: the single merge's check names it, as plan does)."""
    try:
        docs = parse_documents(text)
    except ConfigError:
        return False
    return len(docs) == 1 and isinstance(docs[0], dict) and "experts" in docs[0] and "merge_method" not in docs[0]


def load_moe_text(text: str, *, allow_all_same: bool = False, source: str = "config") -> MoeConfig:
    """Parse and validate a mergekit-moe config; raises :class:`ConfigError` naming the YAML path of the first
    problem. ``allow_all_same`` is ``--i-understand-this-is-not-useful-without-training``."""
    docs = parse_documents(text, source=source)
    doc = docs[0]
    if len(docs) != 1 or not isinstance(doc, dict):
        raise ConfigError(f"{source} must be one YAML mapping")
    unknown = sorted(str(k) for k in doc if k not in TOP_LEVEL_KEYS)
    if unknown:  # a key holding YAML anchors the config uses is ignored, as mergekit-moe ignores every unknown key
        holders = anchor_holders(text)
        unknown = [k for k in unknown if k not in holders]
    if unknown:
        near = near_key(unknown[0], TOP_LEVEL_KEYS, doc)
        raise ConfigError(f"unknown key {unknown[0]!r}", yaml_path=unknown[0],
                          hint=f"did you mean {near!r}?" if near else
                          f"allowed top-level keys of a mergekit-moe config: {', '.join(sorted(TOP_LEVEL_KEYS))}")
    if doc.get("base_model") is None:
        raise ConfigError("base_model is required", yaml_path="base_model")
    gate_mode = doc.get("gate_mode", "hidden")
    if gate_mode not in GATE_MODES:
        raise ConfigError(f"unknown gate_mode {gate_mode!r}", yaml_path="gate_mode",
                          hint=f"gate modes: {', '.join(GATE_MODES)}")
    dtype = doc.get("dtype")
    if dtype is not None:
        dtype = check_dtype(str(dtype), "dtype", unknown="unknown dtype")
    per_token = doc.get("experts_per_token", 2)
    if isinstance(per_token, bool) or not isinstance(per_token, int):
        raise ConfigError("experts_per_token must be an integer", yaml_path="experts_per_token")
    architecture = doc.get("architecture")
    if architecture is not None and not isinstance(architecture, str):
        raise ConfigError("architecture must be a string", yaml_path="architecture")
    config = MoeConfig(
        text=text,
        base_model=_model(doc["base_model"], "base_model"),
        experts=_experts(doc.get("experts"), "experts", required=True),
        gate_mode=gate_mode,
        dtype=dtype,
        experts_per_token=per_token,
        shared_experts=_experts(doc.get("shared_experts"), "shared_experts", required=False),
        architecture=architecture,
    )
    _check(config, allow_all_same)
    return config


def _check(config: MoeConfig, allow_all_same: bool) -> None:
    """mergekit-moe's ``is_bad_config``, in its order and with its words, then the shared experts' prompts."""
    if config.experts_per_token < 1:
        raise ConfigError("Experts per token must be >= 1", yaml_path="experts_per_token")
    if len(config.experts) < config.experts_per_token:
        raise ConfigError("Must include at least as many experts as experts_per_token.", yaml_path="experts",
                          hint=f"{len(config.experts)} experts, experts_per_token {config.experts_per_token}")
    if config.gate_mode != "random":
        for i, expert in enumerate(config.experts):
            if not expert.positive_prompts:
                raise ConfigError(f"Expert {i} has no positive prompts.",
                                  yaml_path=f"{expert.yaml_path}.positive_prompts",
                                  hint=f"gate_mode {config.gate_mode} routes by prompts (only random needs none)")
        first = _prompts(config.experts[0])
        if all(_prompts(e) == first for e in config.experts[1:]):
            raise ConfigError(
                "Your positive and negative prompts are identical for all experts. This will not produce a "
                "functioning MoE.", yaml_path="experts",
                hint="each expert's positive_prompts must hold prompts of what should be routed to it")
        if not allow_all_same and all(e.model.key == config.experts[0].model.key for e in config.experts[1:]):
            raise ConfigError(
                "All of your expert models are the same. This will produce a model that uses more resources but "
                "gives the exact same output.", yaml_path="experts",
                hint="to train the model after merging, pass --i-understand-this-is-not-useful-without-training")
    if config.shared_experts:
        prompted = [bool(e.positive_prompts) for e in config.shared_experts]
        if any(prompted) and not all(prompted):
            raise ConfigError("Must specify prompts for all shared experts or none, not a mix",
                              yaml_path="shared_experts")


def _prompts(expert: ExpertConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return expert.positive_prompts or (), expert.negative_prompts or ()


def _experts(value: Any, path: str, *, required: bool) -> tuple[ExpertConfig, ...]:
    if value is None:
        if required:
            raise ConfigError(f"{path} is required", yaml_path=path)
        return ()
    if not isinstance(value, list) or (required and not value):
        raise ConfigError(f"{path} must be a non-empty list of experts" if required else f"{path} must be a list",
                          yaml_path=path)
    return tuple(_expert(item, f"{path}[{i}]") for i, item in enumerate(value))


def _expert(item: Any, path: str) -> ExpertConfig:
    if not isinstance(item, dict):
        raise ConfigError("an expert must be a mapping with source_model", yaml_path=path)
    unknown = sorted(str(k) for k in item if k not in EXPERT_KEYS)
    if unknown:
        near = near_key(unknown[0], EXPERT_KEYS, item)
        raise ConfigError(f"unknown key {unknown[0]!r}", yaml_path=f"{path}.{unknown[0]}",
                          hint=f"did you mean {near!r}?" if near
                          else f"an expert's keys: {', '.join(sorted(EXPERT_KEYS))}")
    if item.get("source_model") is None:
        raise ConfigError("source_model is required", yaml_path=f"{path}.source_model")
    return ExpertConfig(
        model=_model(item["source_model"], f"{path}.source_model"),
        positive_prompts=_prompt_list(item.get("positive_prompts"), f"{path}.positive_prompts"),
        negative_prompts=_prompt_list(item.get("negative_prompts"), f"{path}.negative_prompts"),
        noise_scale=_number(item.get("noise_scale"), f"{path}.noise_scale"),
        residual_scale=_number(item.get("residual_scale"), f"{path}.residual_scale"),
        yaml_path=path,
    )


def _model(value: Any, path: str) -> ModelRef:
    if not isinstance(value, str):
        raise ConfigError("a model must be a string (a path or a hub id, with an optional @revision)", yaml_path=path)
    try:
        ref = parse_model_ref(value)
    except ValueError as exc:
        raise ConfigError(str(exc), yaml_path=path) from None
    if ref.lora is not None:
        raise ConfigError(f"{value}: LoRA adapters are not merged into MoE experts", yaml_path=path,
                          hint="merge the adapter first (resumerge run with a passthrough config), then use that model")
    return ref


def _prompt_list(value: Any, path: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ConfigError("prompts must be a list of strings", yaml_path=path)
    return tuple(value)


def _number(value: Any, path: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError("must be a number", yaml_path=path)
    return float(value)
