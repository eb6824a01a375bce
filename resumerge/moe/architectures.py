"""Which MoE output a config makes (mergekit-moe 0.1.5's candidates and selection rules), from the inputs'
config.json files; and the header checks mergekit leaves to crash (layer counts, sizes, the shared expert's
model). Nothing here reads a weight."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs.model import ModelInput
from resumerge.moe.config import ExpertConfig, MoeConfig

MIXTRAL = "Mixtral"
DEEPSEEK = "DeepSeek MoE"
QWEN = "Qwen MoE"
QWEN3 = "Qwen3 MoE"
# mergekit's candidates, in its order.
KINDS = (MIXTRAL, DEEPSEEK, QWEN, QWEN3)


@dataclass(frozen=True)
class Choice:
    """The chosen output kind and what the user must hear about the choice."""

    kind: str
    notes: tuple[str, ...]


def choose_output(config: MoeConfig, models: Mapping[str, ModelInput]) -> Choice:
    """The output kind of ``config``: ``architecture:`` filters by name prefix, Mixtral wins whenever it
    qualifies, else the first that does. Raises :class:`ConfigError` (exit 2) when none does, with the reasons."""
    names: tuple[str, ...] = KINDS
    if config.architecture is not None:
        names = tuple(k for k in KINDS if k.lower().startswith(config.architecture.lower()))
        if not names:
            raise ConfigError(f"No output architecture found that matches the given architecture: "
                              f"{config.architecture}", yaml_path="architecture",
                              hint=f"the output architectures are {', '.join(KINDS)}")
    reasons = {kind: _refusal(kind, config, models) for kind in names}
    fits = [kind for kind in names if reasons[kind] is None]
    if not fits:
        why = "; ".join(f"{kind}: {reasons[kind]}" for kind in names)
        raise ConfigError("No output architecture found that is compatible with the given models", yaml_path=
                          "architecture" if config.architecture is not None else "experts", hint=why)
    if MIXTRAL in fits:
        return Choice(MIXTRAL, ())
    notes = (f"several output architectures fit ({', '.join(fits)}); defaulting to {fits[0]}",) if len(fits) > 1 \
        else ()
    return Choice(fits[0], notes)


def _refusal(kind: str, config: MoeConfig, models: Mapping[str, ModelInput]) -> str | None:
    """Why ``kind`` cannot be made from ``config`` (mergekit's support rules), or None when it can."""
    shared = config.shared_experts
    types = [_model_type(models[config.base_model.key])] + [_model_type(models[e.model.key]) for e in config.experts]
    if kind == MIXTRAL:
        if shared:
            return "it has no shared experts"
        allowed: tuple[str, ...] = ("llama", "mistral")
    elif kind == DEEPSEEK:
        if len(shared) > 1:
            return "it takes at most one shared expert"
        if shared and (shared[0].positive_prompts or shared[0].negative_prompts):
            return "its shared expert cannot be gated (give it no prompts)"
        allowed = ("llama", "mistral")
    elif kind == QWEN:
        if len(shared) != 1:
            return "it needs exactly one shared expert"
        if config.gate_mode != "random" and not shared[0].positive_prompts:
            return "its shared expert needs prompts (unless gate_mode is random)"
        allowed = ("llama", "mistral", "qwen2")
    else:
        if shared:
            return "it has no shared experts"
        return None if all(t == "qwen3" for t in types) else "every model must be qwen3"
    types += [_model_type(models[e.model.key]) for e in shared]
    if len(set(types)) != 1:
        return f"all models must have the same model_type (got {', '.join(sorted(set(types)))})"
    if types[0] not in allowed:
        return f"the models must be {' or '.join(allowed)} (got {types[0]})"
    return None


def check_experts(config: MoeConfig, kind: str, models: Mapping[str, ModelInput]) -> None:
    """Refuse, before any weight is read, experts whose layer count, hidden size or MLP tensors differ from the
    base's, and (DeepSeek and Qwen outputs) a shared expert that is neither the base nor a routed expert, which
    mergekit-moe crashes on."""
    base = models[config.base_model.key]
    layers, hidden = _int(base, "num_hidden_layers", "base_model"), _int(base, "hidden_size", "base_model")
    for expert in (*config.experts, *config.shared_experts):
        model = models[expert.model.key]
        where = f"{expert.yaml_path}.source_model"
        if _model_type(model) != _model_type(base):
            raise ConfigError(f"{expert.model.key} is a {_model_type(model)} model, the base is "
                              f"{_model_type(base)}", yaml_path=where)
        if _int(model, "num_hidden_layers", where) != layers:
            raise ConfigError(f"{expert.model.key} has {model.config['num_hidden_layers']} layers, the base has "
                              f"{layers}", yaml_path=where, hint="every expert must have the base's layer count")
        if _int(model, "hidden_size", where) != hidden:
            raise ConfigError(f"{expert.model.key} has hidden_size {model.config['hidden_size']}, the base has "
                              f"{hidden}", yaml_path=where)
        _check_mlps(model, expert, layers)
    if kind in (DEEPSEEK, QWEN) and config.shared_experts:
        known = {config.base_model.key} | {e.model.key for e in config.experts}
        shared = config.shared_experts[0]
        if shared.model.key not in known:
            raise ConfigError(f"the shared expert {shared.model.key} is neither the base model nor a routed expert",
                              yaml_path=f"{shared.yaml_path}.source_model",
                              hint="mergekit-moe cannot load it (it crashes); use the base or one of the experts")


def _check_mlps(model: ModelInput, expert: ExpertConfig, layers: int) -> None:
    for layer in range(layers):
        for part in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.{part}.weight"
            if name not in model.tensors:
                raise ModelInputError(f"Tensor {name} required but not present in model {expert.model.key}",
                                      yaml_path=f"{expert.yaml_path}.source_model", tensor=name)


def _model_type(model: ModelInput) -> str:
    return str(model.config.get("model_type", ""))


def _int(model: ModelInput, key: str, where: str) -> int:
    value = model.config.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelInputError(f"{model.ref.key}: config.json has no integer {key}", yaml_path=where)
    return value
