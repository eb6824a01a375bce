"""Merge-method parameters from YAML: the value a tensor gets at a level (``filter`` conditionals and gradients
evaluated, coerced to the parameter's kind, range-checked), and names no method knows (typos) refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from resumerge.config.merge_config import MergeConfig
from resumerge.config.params import Setting, coerce, evaluate, is_missing
from resumerge.errors import ConfigError
from resumerge.methods.registry import MethodSpec, parameter_names

# What :func:`parameter_value` returns for a parameter no level sets: the method's declaration supplies its default
# (MethodSpec.bind), so defaults are filled in one place.
UNSET: Final = object()


def parameter_value(
    spec: Any, levels: list[tuple[Mapping[str, Setting], str]], match_name: str, t: float, out_name: str, where: str
) -> Any:
    """The value of parameter ``spec`` at the first of ``levels`` that sets it for ``match_name`` at layer position
    ``t`` (coerced, range-checked), :data:`UNSET` when none does; a required one left unset is a ConfigError."""
    for params, path in levels:
        if spec.name not in params:
            continue
        value = evaluate(params[spec.name], match_name, t)
        if is_missing(value):
            continue
        try:
            value = coerce(value, spec.kind)
        except ValueError as exc:
            raise ConfigError(f"parameter {spec.name}: {exc}", yaml_path=f"{path}.{spec.name}") from None
        _check_range(spec, value, f"{path}.{spec.name}")
        return value
    if spec.required:
        raise ConfigError(
            f"Missing required parameter {spec.name} for {out_name}",
            yaml_path=f"{where}.{spec.name}",
            hint=f"set {spec.name} for this model, its slice, or globally under parameters:",
        )
    return UNSET


def _check_range(spec: Any, value: Any, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low_bad = spec.minimum is not None and (value <= spec.minimum if spec.exclusive_min else value < spec.minimum)
    high_bad = spec.maximum is not None and value > spec.maximum
    if low_bad or high_bad:
        low = "(" if spec.exclusive_min else "["
        raise ConfigError(
            f"{spec.name} = {value} is out of range {low}{spec.minimum}, {spec.maximum}]", yaml_path=path
        )


def parameter_places(config: MergeConfig) -> list[tuple[str, Mapping[str, Setting]]]:
    """Every ``parameters:`` mapping of ``config`` with its YAML path: top level, modules, models, slices and
    slice sources."""
    places: list[tuple[str, Mapping[str, Setting]]] = [("parameters", config.parameters)]
    places.extend((f"{m.yaml_path}.parameters", m.parameters) for m in config.modules or ())
    for src in config.all_models():
        places.append((f"{src.yaml_path}.parameters", src.parameters))
    for sl in config.all_slices():
        places.append((f"{sl.yaml_path}.parameters", sl.parameters))
        places.extend((f"{s.yaml_path}.parameters", s.parameters) for s in sl.sources)
    return places


def check_parameter_names(config: MergeConfig, method: MethodSpec) -> None:
    # A name some method declares but not the chosen one is fine (a switched method); one no method declares is
    # a typo worth stopping for.
    own = {p.name for p in method.params}
    known = parameter_names() | own
    for path, params in parameter_places(config):
        for name in params:
            if name not in known:
                raise ConfigError(
                    f"unknown parameter {name!r}",
                    yaml_path=f"{path}.{name}",
                    hint=f"merge method {method.name} takes: {', '.join(sorted(own)) or 'no parameters'}",
                )
