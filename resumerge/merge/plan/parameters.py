"""Merge-method parameters from YAML: the value a tensor gets at a level (``filter`` conditionals and gradients
evaluated, coerced to the parameter's kind, range-checked), every parameter of an output tensor resolved
(:class:`ParameterResolver`), and names no method knows (typos) refused."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

from resumerge.config.merge_config import MergeConfig, near_key
from resumerge.config.params import Setting, coerce, evaluate, filter_matches, is_catch_all, is_missing
from resumerge.errors import ConfigError
from resumerge.merge.methods.registry import MethodSpec, Scope, get_method, method_names, parameter_names
from resumerge.merge.plan.architecture import is_head, is_input_embedding
from resumerge.merge.plan.filters import FilterTally

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


def checked_method(config: MergeConfig) -> MethodSpec:
    """The merge method ``config`` names, with the names of its parameters checked: what the YAML alone settles,
    asked before any model is opened or downloaded (a ConfigError, exit 2, for an unknown method or parameter)."""
    method = get_method(config.merge_method)
    if method is None:
        near = near_key(config.merge_method, method_names())
        raise ConfigError(
            f"Unimplemented merge method {config.merge_method!r}",
            yaml_path="merge_method",
            hint=f"did you mean {near!r}?" if near else f"known methods: {', '.join(method_names())}",
        )
    check_parameter_names(config, method)
    return method


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


# An output tensor's resolved parameters: the global ones, then each input's, as TensorPlan holds them.
Resolved = tuple[tuple[tuple[str, Any], ...], tuple[tuple[tuple[str, Any], ...], ...]]
_Levels = list[tuple[Mapping[str, Setting], str]]


class Source(Protocol):
    """A slice's source as parameter resolution sees it: its ``parameters:`` and its YAML path."""

    @property
    def parameters(self) -> Mapping[str, Setting]: ...

    @property
    def yaml_path(self) -> str: ...


class ParameterScope(Protocol):
    """A slice as parameter resolution sees it: its sources, its own and its ``modules:`` entry's parameters, with
    their YAML paths."""

    @property
    def sources(self) -> Sequence[Source]: ...

    @property
    def parameters(self) -> Mapping[str, Setting]: ...

    @property
    def yaml_path(self) -> str: ...

    @property
    def module_parameters(self) -> Mapping[str, Setting]: ...

    @property
    def module_path(self) -> str: ...


class ParameterResolver:
    """Every method parameter of the output tensors of one plan build (:meth:`resolve`), each answer worked out once
    per exact key and shared by the tensors with that key.

    A tensor's parameters depend on its slice (the levels consulted, the base), the method, and on the tensor only
    through its layer position ``t`` where a consulted setting is a list (a gradient, a list by position, a
    conditional entry's gradient) and through its names where a consulted setting has a ``filter:``, and then only
    through which of those patterns each name matches. So the key is the slice and method, ``t`` when it matters,
    the base, and each name's matches of the slice's patterns: a 92k-tensor merge with plain settings resolves once
    per slice (and layer, with a gradient), never by a guess about names. An error is raised by the first tensor
    of its key, as it would be without the sharing. The ``filters`` tally still sees every tensor.
    """

    def __init__(self, config: MergeConfig, filters: FilterTally) -> None:
        self._config = config
        self._filters = filters
        self._scopes: dict[tuple[int, int], _ScopeLevels] = {}

    def resolve(self, method: MethodSpec, scope: ParameterScope, out_name: str, in_names: Sequence[str], t: float,
                base_index: int | None) -> Resolved:
        """The global and per-input parameters of output tensor ``out_name`` of ``scope`` (its inputs named
        ``in_names``, in the order of the scope's sources) at layer position ``t``, defaults filled in by
        ``method`` (:meth:`~resumerge.merge.methods.spec.MethodSpec.bind`) and checked by it; raises ConfigError with
        the YAML path for a value out of range, a required one missing or a combination the method refuses."""
        levels = self._scopes.get((id(scope), id(method)))
        if levels is None:
            levels = self._scopes[(id(scope), id(method))] = _ScopeLevels(scope, method, self._config)
        if self._filters.active:
            levels.observe(self._filters, out_name, in_names, base_index)
        key = levels.key(out_name, in_names, t, base_index)
        found = levels.resolved.get(key)
        if found is None:
            found = levels.resolved[key] = levels.resolve(out_name, in_names, t, base_index)
        return found


class _ScopeLevels:
    """The parameter levels of one (slice, method), what its answers depend on, and its answers by key. It holds
    the slice and the method, so their ids (the resolver's key) stay theirs while it lives."""

    def __init__(self, scope: ParameterScope, method: MethodSpec, config: MergeConfig) -> None:
        self.scope, self.method = scope, method
        shared: _Levels = [(scope.parameters, f"{scope.yaml_path}.parameters"),
                           (scope.module_parameters, f"{scope.module_path}.parameters"),
                           (config.parameters, "parameters")]
        self.global_levels = shared
        self.source_levels = [[(src.parameters, f"{src.yaml_path}.parameters"), *shared] for src in scope.sources]
        consulted = [params[spec.name] for levels in (shared, *self.source_levels) for params, _ in levels
                     for spec in method.params if spec.name in params]
        self.by_t = any(_varies_with_t(setting) for setting in consulted)
        self.patterns = tuple(dict.fromkeys(
            entry["filter"] for setting in consulted if _is_conditional(setting) for entry in setting
            if not is_catch_all(entry.get("filter"))))
        self.resolved: dict[tuple[Any, ...], Resolved] = {}

    def key(self, out_name: str, in_names: Sequence[str], t: float, base_index: int | None) -> tuple[Any, ...]:
        matched = tuple(filter_matches(p, n) for n in (out_name, *in_names) for p in self.patterns)
        return (t if self.by_t else None, base_index, matched, self.vocab(out_name))

    def vocab(self, out_name: str) -> bool:
        """Whether ``out_name`` takes the method's vocabulary defaults (a method without any: never)."""
        return bool(self.method.vocab_defaults) and (is_input_embedding(out_name) or is_head(out_name))

    def observe(self, filters: FilterTally, out_name: str, in_names: Sequence[str], base_index: int | None) -> None:
        """Show ``filters`` every filter consulted for ``out_name``, in the order :meth:`resolve` consults them."""
        for spec in self.method.params:
            if spec.scope is Scope.GLOBAL:
                filters.observe(self.global_levels, spec.name, out_name, out_name)
                continue
            for i, in_name in enumerate(in_names):
                if not (spec.scope is Scope.NON_BASE and i == base_index):
                    filters.observe(self.source_levels[i], spec.name, in_name, out_name)

    def resolve(self, out_name: str, in_names: Sequence[str], t: float, base_index: int | None) -> Resolved:
        method = self.method
        global_values: dict[str, Any] = {}
        per_model: list[dict[str, Any]] = [{} for _ in self.source_levels]
        for spec in method.params:
            if spec.scope is Scope.GLOBAL:
                value = parameter_value(spec, self.global_levels, out_name, t, out_name, "parameters")
                if value is not UNSET:
                    global_values[spec.name] = value
                continue
            for i, (levels, in_name) in enumerate(zip(self.source_levels, in_names)):
                if spec.scope is Scope.NON_BASE and i == base_index:
                    continue
                value = parameter_value(spec, levels, in_name, t, out_name, levels[0][1])
                if value is not UNSET:
                    per_model[i][spec.name] = value
        if self.vocab(out_name):
            global_values = dict(method.vocab_defaults) | global_values
        per_model, global_values = method.bind(per_model, global_values, base_index)
        if method.check is not None:
            problem = method.check(global_values, per_model)
            if problem:
                raise ConfigError(problem, yaml_path=f"{self.scope.yaml_path}.parameters", tensor=out_name)
        return tuple(sorted(global_values.items())), tuple(tuple(sorted(p.items())) for p in per_model)


def _is_conditional(setting: Setting) -> bool:
    return isinstance(setting, list) and bool(setting) and isinstance(setting[0], dict)


def _varies_with_t(setting: Setting) -> bool:
    """Whether :func:`~resumerge.config.params.evaluate` of ``setting`` may depend on the layer position: a list,
    but for a conditional one whose values are all scalars."""
    if _is_conditional(setting):
        return any(isinstance(entry.get("value"), list) for entry in setting)
    return isinstance(setting, list)
