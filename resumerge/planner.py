"""Build the frozen :class:`~resumerge.plan.Plan` from a validated config and the inputs' headers.

Pure with respect to weights: only config.json files and safetensors headers are consulted, so every mistake
(layer ranges, slice lengths, missing parameters, method contracts, shape mismatches) is reported before any
weight is read or written. Layer renumbering, parameter precedence, the ``t`` rule and where embeddings and
final norm / lm_head come from follow mergekit (see ``shared/reference/mergekit-semantics.md`` §1.3, §3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from resumerge.architecture import TIED_NAMES, Layout, infer_layout
from resumerge.config import MergeConfig, SourceConfig
from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs import ModelInput
from resumerge.methods.registry import BasePolicy, MethodSpec, Scope, get_method, method_names
from resumerge.modelref import ModelRef
from resumerge.outconfig import build_out_config
from resumerge.outputs import tokenizer_files
from resumerge.params import Setting, coerce, evaluate, is_missing
from resumerge.plan import InputRef, Plan, PlanOptions, TensorPlan, compute_fingerprint
from resumerge.safetensors_format import DTYPE_SIZES, numel
from resumerge.sharding import assign_shards

DTYPE_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64"}
# Parameter names mergekit knows for some method: unused by the chosen method is fine (a switched method),
# unknown to all of them is a typo worth stopping for.
KNOWN_PARAMETERS = frozenset(
    {
        "weight", "density", "gamma", "epsilon", "lambda", "normalize", "rescale", "int8_mask", "t",
        "filter_wise", "select_topk", "nuslerp_flatten", "nuslerp_row_wise", "max_iter", "tol", "eps",
        "scale", "normalize_weights", "r", "alpha",
    }
)


@dataclass(frozen=True)
class _Slice:
    sources: tuple[SourceConfig, ...]
    ranges: tuple[tuple[int, int], ...]
    base: ModelRef | None
    parameters: Mapping[str, Setting]
    yaml_path: str


def build_plan(config: MergeConfig, models: Mapping[str, ModelInput], options: PlanOptions) -> Plan:
    """Plan every output tensor of ``config`` over the opened ``models`` (keyed by ``ModelRef.key``).

    Raises :class:`ConfigError` (with the YAML path) or :class:`ModelInputError` for anything that would fail
    later; returns a plan with its fingerprint set.
    """
    method = get_method(config.merge_method)
    if method is None:
        raise ConfigError(
            f"Unimplemented merge method {config.merge_method!r}",
            yaml_path="merge_method",
            hint=f"known methods: {', '.join(method_names())}",
        )
    _check_parameter_names(config, method)
    layouts = {key: infer_layout(m.tensors, m.config, where=str(m.directory)) for key, m in models.items()}
    slices = _normalise(config, method, layouts)
    tensors: dict[str, TensorPlan] = {}
    origins: list[tuple[str, int]] = []
    for s_index, sl in enumerate(slices):
        _check_slice(sl, method, layouts)
        length = sl.ranges[0][1] - sl.ranges[0][0]
        first = layouts[sl.sources[0].model.key]
        for k in range(length):
            t = 1.0 if length == 1 else k / (length - 1)
            out_layer = len(origins)
            origins.append((sl.sources[0].model.key, sl.ranges[0][0] + k))
            for suffix in first.layer_suffixes:
                out_name = first.layer_name(out_layer, suffix)
                names = [
                    layouts[src.model.key].layer_name(rng[0] + k, suffix) for src, rng in zip(sl.sources, sl.ranges)
                ]
                tensors[out_name] = _tensor(out_name, names, sl, t, method, config, models)
        if s_index == 0:
            for name in first.pre:
                tensors[name] = _edge_tensor(name, sl, method, config, models)
    last = slices[-1]
    post_names: list[str] = []
    for src in last.sources:
        post_names.extend(n for n in layouts[src.model.key].post if n not in post_names)
    for name in post_names:
        tensors[name] = _edge_tensor(name, last, method, config, models)
    shards, tensors = assign_shards(tensors, options.out_shard_size)
    donor = _donor(config)
    tokenizer_donor = _tokenizer_donor(config, donor, options)
    plan = Plan(
        method=method.name,
        tensors=tensors,
        shards=shards,
        donor=donor,
        tokenizer_donor=tokenizer_donor,
        num_layers=len(origins),
        layer_origins=tuple(origins),
        inputs={key: tuple((f.name, f.size, f.identity) for f in m.files) for key, m in sorted(models.items())},
        model_dirs={key: str(m.directory) for key, m in models.items()},
        options=options,
        out_config=build_out_config(config, models, donor, tuple(origins), tensors),
        tokenizer_files=tokenizer_files(models[tokenizer_donor].directory) if tokenizer_donor else (),
    )
    return replace(plan, fingerprint=compute_fingerprint(plan))


def _normalise(config: MergeConfig, method: MethodSpec, layouts: Mapping[str, Layout]) -> list[_Slice]:
    if config.base_model is not None and method.base is BasePolicy.FORBIDDEN:
        raise ConfigError(f"merge method {method.name} does not accept a base model", yaml_path="base_model")
    if config.models is not None:
        sources = list(config.models)
        base = config.base_model
        if base is not None and base.key not in {s.model.key for s in sources}:
            # mergekit: "Base model specified but not in input models - adding"
            sources.insert(0, SourceConfig(base, None, {}, "base_model"))
        counts = {s.model.key: layouts[s.model.key].num_layers for s in sources}
        if len(set(counts.values())) > 1:
            listing = ", ".join(f"{k}: {v}" for k, v in counts.items())
            raise ConfigError(
                f"models have different layer counts ({listing})",
                yaml_path="models",
                hint="use slices: with matching layer_range lengths per slice",
            )
        n = next(iter(counts.values()))
        return [_Slice(tuple(sources), tuple((0, n) for _ in sources), base, {}, "models")]
    out = []
    for sl in config.slices or ():
        base = sl.base_model or config.base_model
        ranges = tuple(s.layer_range or (0, 0) for s in sl.sources)
        out.append(_Slice(sl.sources, ranges, base, sl.parameters, sl.yaml_path))
    return out


def _check_slice(sl: _Slice, method: MethodSpec, layouts: Mapping[str, Layout]) -> None:
    for src, (start, end) in zip(sl.sources, sl.ranges):
        available = layouts[src.model.key].num_layers
        if end > available:
            raise ConfigError(
                f"layer_range [{start}, {end}] is past the end of {src.model.key}, which has {available} layers",
                yaml_path=f"{src.yaml_path}.layer_range",
                hint=f"use an end of at most {available} (end is exclusive)",
            )
    lengths = {src.model.key + f"[{s}:{e}]": e - s for src, (s, e) in zip(sl.sources, sl.ranges)}
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{k} has {v}" for k, v in lengths.items())
        raise ConfigError(
            f"All inputs to a slice must contain the same number of layers: {listing}",
            yaml_path=f"{sl.yaml_path}.sources",
            hint="give each source the same layer_range length, or put them in separate slices",
        )
    n = len(sl.sources)
    base_in = sl.base is not None and sl.base.key in {s.model.key for s in sl.sources}
    if method.base is BasePolicy.REQUIRED and not base_in:
        what = "no base_model is set" if sl.base is None else f"base {sl.base.key} is not among its sources"
        raise ConfigError(
            f"merge method {method.name} requires a base model, but {what}",
            yaml_path=sl.yaml_path,
            hint="set base_model and list it among the slice's sources",
        )
    others = n - (1 if base_in else 0)
    low = method.min_non_base or 0
    if others < low or (method.max_non_base is not None and others > method.max_non_base):
        want = f"exactly {low}" if method.max_non_base == low else f"at least {low}"
        raise ConfigError(
            f"merge method {method.name} takes {want} models besides the base, got {others}",
            yaml_path=f"{sl.yaml_path}.sources" if sl.yaml_path != "models" else "models",
        )
    if n < method.min_inputs or (method.max_inputs is not None and n > method.max_inputs):
        want = (
            f"exactly {method.min_inputs}"
            if method.max_inputs == method.min_inputs
            else f"at least {method.min_inputs}"
            if method.max_inputs is None
            else f"{method.min_inputs} to {method.max_inputs}"
        )
        raise ConfigError(
            f"merge method {method.name} takes {want} inputs (base included), got {n}",
            yaml_path=f"{sl.yaml_path}.sources" if sl.yaml_path != "models" else "models",
        )


def _tensor(
    out_name: str,
    in_names: list[str],
    sl: _Slice,
    t: float,
    method: MethodSpec,
    config: MergeConfig,
    models: Mapping[str, ModelInput],
) -> TensorPlan:
    inputs = []
    for src, name in zip(sl.sources, in_names):
        model = models[src.model.key]
        found = model.tensors.get(name)
        if found is None:
            raise ModelInputError(
                f"Tensor {name} required but not present in model {src.model.key}",
                yaml_path=src.yaml_path,
                tensor=name,
            )
        e = found.entry
        inputs.append(InputRef(src.model.key, found.file, name, e.dtype, e.shape, e.start, e.end))
    shapes = {i.shape for i in inputs}
    if len(shapes) > 1:
        listing = ", ".join(f"{i.model}: {list(i.shape)}" for i in inputs)
        vocab = any(m in out_name for m in ("embed", "lm_head", "wte"))
        raise ModelInputError(
            f"Tensor size mismatch for {out_name}: {listing}",
            yaml_path=sl.yaml_path,
            tensor=out_name,
            hint=(
                "the vocabularies differ; tokenizer-based vocabulary alignment is not supported by this version"
                if vocab
                else "these models have different architectures or sizes and cannot be merged tensor by tensor"
            ),
        )
    base_index = None
    if sl.base is not None:
        keys = [s.model.key for s in sl.sources]
        base_index = keys.index(sl.base.key) if sl.base.key in keys else None
    g_params, m_params = _resolve_params(out_name, in_names, sl, t, method, config, base_index)
    shape = inputs[0].shape
    out_code = _out_dtype(config, inputs, base_index)
    if config.out_dtype is None and method.half_result_float32 and out_code in ("F16", "BF16"):
        out_code = "F32"
    return TensorPlan(
        name=out_name,
        shard="",
        method=method.name,
        inputs=tuple(inputs),
        base_index=base_index,
        model_params=m_params,
        params=g_params,
        shape=shape,
        compute_dtype=config.dtype,
        out_dtype=out_code,
        nbytes=numel(shape) * DTYPE_SIZES[out_code],
    )


def _edge_tensor(
    name: str,
    sl: _Slice,
    method: MethodSpec,
    config: MergeConfig,
    models: Mapping[str, ModelInput],
) -> TensorPlan:
    """A pre- or post-layer tensor: t = 0, taken from the slice's models, tied names standing in."""
    in_names = []
    for src in sl.sources:
        have = models[src.model.key].tensors
        if name in have:
            in_names.append(name)
            continue
        tied = next((alt for alt in TIED_NAMES.get(name, ()) if alt in have), None)
        in_names.append(tied or name)  # a missing tensor is reported by _tensor with the model's name
    return _tensor(name, in_names, sl, 0.0, method, config, models)


def _resolve_params(
    out_name: str,
    in_names: list[str],
    sl: _Slice,
    t: float,
    method: MethodSpec,
    config: MergeConfig,
    base_index: int | None,
) -> tuple[tuple[tuple[str, Any], ...], tuple[tuple[tuple[str, Any], ...], ...]]:
    global_values: dict[str, Any] = {}
    per_model: list[dict[str, Any]] = [{} for _ in sl.sources]
    for spec in method.params:
        if spec.scope is Scope.GLOBAL:
            levels = [(sl.parameters, f"{sl.yaml_path}.parameters"), (config.parameters, "parameters")]
            global_values[spec.name] = _value(spec, levels, out_name, t, out_name, "parameters")
            continue
        for i, (src, in_name) in enumerate(zip(sl.sources, in_names)):
            if spec.scope is Scope.NON_BASE and i == base_index:
                continue
            levels = [
                (src.parameters, f"{src.yaml_path}.parameters"),
                (sl.parameters, f"{sl.yaml_path}.parameters"),
                (config.parameters, "parameters"),
            ]
            per_model[i][spec.name] = _value(spec, levels, in_name, t, out_name, f"{src.yaml_path}.parameters")
    if method.check is not None:
        problem = method.check(global_values, per_model)
        if problem:
            raise ConfigError(problem, yaml_path=f"{sl.yaml_path}.parameters", tensor=out_name)
    return (
        tuple(sorted(global_values.items())),
        tuple(tuple(sorted(p.items())) for p in per_model),
    )


def _value(
    spec: Any, levels: list[tuple[Mapping[str, Setting], str]], match_name: str, t: float, out_name: str, where: str
) -> Any:
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
    return spec.default


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


def _out_dtype(config: MergeConfig, inputs: list[InputRef], base_index: int | None) -> str:
    if config.out_dtype is not None:
        return DTYPE_CODES[config.out_dtype]
    if config.dtype is not None:
        return DTYPE_CODES[config.dtype]
    return inputs[base_index if base_index is not None else 0].dtype


def _check_parameter_names(config: MergeConfig, method: MethodSpec) -> None:
    own = {p.name for p in method.params}
    known = KNOWN_PARAMETERS | own
    places: list[tuple[str, Mapping[str, Setting]]] = [("parameters", config.parameters)]
    for src in config.models or ():
        places.append((f"{src.yaml_path}.parameters", src.parameters))
    for sl in config.slices or ():
        places.append((f"{sl.yaml_path}.parameters", sl.parameters))
        places.extend((f"{s.yaml_path}.parameters", s.parameters) for s in sl.sources)
    for path, params in places:
        for name in params:
            if name not in known:
                raise ConfigError(
                    f"unknown parameter {name!r}",
                    yaml_path=f"{path}.{name}",
                    hint=f"merge method {method.name} takes: {', '.join(sorted(own)) or 'no parameters'}",
                )


def _donor(config: MergeConfig) -> str:
    # Deterministic, unlike mergekit's set-ordered choice (defect 1): base model, else the first model listed.
    if config.base_model is not None:
        return config.base_model.key
    if config.models:
        return config.models[0].model.key
    assert config.slices
    return config.slices[0].sources[0].model.key


def _tokenizer_donor(config: MergeConfig, donor: str, options: PlanOptions) -> str | None:
    if config.tokenizer is not None or config.tokenizer_source == "union":
        path = "tokenizer" if config.tokenizer is not None else "tokenizer_source"
        raise ConfigError(
            "building a merged tokenizer (union / tokenizer: section) is not supported by this version",
            yaml_path=path,
            hint="remove it to copy the base model's tokenizer, or name one model as tokenizer_source",
        )
    if config.tokenizer_source not in (None, "base"):
        if config.tokenizer_source not in {r.key for r in config.referenced_models()}:
            raise ConfigError(
                f"tokenizer_source {config.tokenizer_source!r} is not one of the merged models",
                yaml_path="tokenizer_source",
                hint="name a model exactly as it is written under models: or slices:",
            )
        return config.tokenizer_source
    if config.tokenizer_source == "base" and config.base_model is None:
        raise ConfigError("tokenizer_source: base needs a base_model", yaml_path="tokenizer_source")
    return donor if options.copy_tokenizer else None
