"""Which MoE output a config makes (mergekit-moe 0.1.5's candidates and selection rules), from the inputs'
config.json files; and the header checks mergekit leaves to crash (layer counts, sizes, the shared expert's
model). Nothing here reads a weight."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs.model import ModelInput
from resumerge.runs.moe.config import ExpertConfig, MoeConfig
from resumerge.runs.moe.outkinds import OUTPUT_KINDS, OutputKind


@dataclass(frozen=True)
class Choice:
    """The chosen output kind and what the user must hear about the choice."""

    kind: OutputKind
    notes: tuple[str, ...]


def choose_output(config: MoeConfig, models: Mapping[str, ModelInput],
                  kinds: tuple[OutputKind, ...] = OUTPUT_KINDS) -> Choice:
    """The output kind of ``config`` among ``kinds`` (mergekit-moe's candidates, in its order):
    ``architecture:`` filters by name prefix, a preferred kind wins whenever it qualifies, else the
    first that does. Raises :class:`ConfigError` (exit 2) when none does, with the reasons."""
    names = tuple(k.name for k in kinds)
    candidates = kinds
    if config.architecture is not None:
        candidates = tuple(k for k in kinds if k.name.lower().startswith(config.architecture.lower()))
        if not candidates:
            raise ConfigError(f"No output architecture found that matches the given architecture: "
                              f"{config.architecture}", yaml_path="architecture",
                              hint=f"the output architectures are {', '.join(names)}")
    reasons = {kind.name: _refusal(kind, config, models) for kind in candidates}
    fits = [kind for kind in candidates if reasons[kind.name] is None]
    if not fits:
        why = "; ".join(f"{kind.name}: {reasons[kind.name]}" for kind in candidates)
        raise ConfigError("No output architecture found that is compatible with the given models", yaml_path=
                          "architecture" if config.architecture is not None else "experts", hint=why)
    preferred = [kind for kind in fits if kind.preferred]
    if preferred:
        return Choice(preferred[0], ())
    notes = (f"several output architectures fit ({', '.join(k.name for k in fits)}); defaulting to "
             f"{fits[0].name}",) if len(fits) > 1 else ()
    return Choice(fits[0], notes)


def _refusal(kind: OutputKind, config: MoeConfig, models: Mapping[str, ModelInput]) -> str | None:
    """Why ``kind`` cannot be made from ``config`` (mergekit's support rules), or None when it can."""
    shared = kind.shared_rule(config)
    if shared is not None:
        return shared
    keys = [config.base_model.key] + [e.model.key for e in (*config.experts, *config.shared_experts)]
    types = [_model_type(models[key]) for key in keys]
    allowed = kind.source_types
    if not kind.same_type:
        return None if all(t in allowed for t in types) else f"every model must be {' or '.join(allowed)}"
    if len(set(types)) != 1:
        return f"all models must have the same model_type (got {', '.join(sorted(set(types)))})"
    if types[0] not in allowed:
        return f"the models must be {' or '.join(allowed)} (got {types[0]})"
    return None


def check_experts(config: MoeConfig, models: Mapping[str, ModelInput]) -> None:
    """Refuse, before any weight is read, experts whose layer count, hidden size or MLP tensors differ from the
    base's, and a shared expert that is neither the base nor a routed expert, which
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
    if config.shared_experts:  # any output that takes one: choose_output refused the others
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
