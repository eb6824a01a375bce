"""Build the frozen :class:`~resumerge.plan.merge_plan.Plan` from a validated config and the inputs' headers.

Pure with respect to weights: only config.json files and safetensors headers are consulted, so every mistake
(layer ranges, slice lengths, missing parameters, method contracts, shape mismatches) is reported before any
weight is read or written. Layer renumbering, parameter precedence, the ``t`` rule and where embeddings and
final norm / lm_head come from follow mergekit (see ``shared/reference/mergekit-semantics.md`` §1.3, §3).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from resumerge.config.merge_config import MergeConfig, SourceConfig
from resumerge.config.modelref import ModelRef
from resumerge.config.params import Setting, coerce, evaluate, is_missing
from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs.catalog import adapter_key
from resumerge.inputs.files import TensorSource, tokenizer_files
from resumerge.inputs.model import ModelInput
from resumerge.inputs.safetensors_format import DTYPE_SIZES, numel
from resumerge.methods.registry import BasePolicy, MethodSpec, Scope, get_method, method_names
from resumerge.plan.architecture import (
    TIED_NAMES,
    Layout,
    check_architectures,
    infer_layout,
    is_head,
    is_input_embedding,
)
from resumerge.plan.merge_plan import InputRef, LoraRef, Plan, PlanOptions, TensorPlan, compute_fingerprint
from resumerge.plan.outconfig import build_out_config
from resumerge.plan.sharding import assign_shards
from resumerge.vocab import (
    BuiltTokenizer,
    TokenizerSpec,
    VocabInput,
    apply_chat_template_files,
    build_tokenizer,
    parse_tokenizer_spec,
    resolve_chat_template,
)

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
    check_architectures(config, models, allow_crimes=options.allow_crimes)
    layouts = {key: infer_layout(m.tensors, m.config, where=str(m.directory)) for key, m in models.items()}
    slices = _normalise(config, method, layouts)
    spec = parse_tokenizer_spec(config.tokenizer_source, config.tokenizer, config.chat_template)
    built = _build_tokenizer(config, spec, models) if spec.builds else None
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
            for suffix in first.suffixes_of(sl.ranges[0][0] + k):  # MoE dense layers have no experts
                out_name = first.layer_name(out_layer, suffix)
                names = [
                    layouts[src.model.key].layer_name(rng[0] + k, suffix) for src, rng in zip(sl.sources, sl.ranges)
                ]
                tensors[out_name] = _tensor(out_name, names, sl, t, method, config, models)
        if s_index == 0:
            for name in first.pre:
                tensors[name] = _edge_tensor(name, sl, method, config, models, built)
    last = slices[-1]
    post_names: list[str] = []
    for src in last.sources:
        post_names.extend(n for n in layouts[src.model.key].post if n not in post_names)
    for name in post_names:
        tensors[name] = _edge_tensor(name, last, method, config, models, built)
    shards, tensors = assign_shards(tensors, options.out_shard_size)
    donor = _donor(config)
    tokenizer_donor, blobs = _tokenizer_output(config, spec, built, donor, options, models)
    plan = Plan(
        method=method.name,
        tensors=tensors,
        shards=shards,
        donor=donor,
        tokenizer_donor=tokenizer_donor,
        num_layers=len(origins),
        layer_origins=tuple(origins),
        inputs=_input_files(models),
        model_dirs=_model_dirs(models),
        options=options,
        out_config=build_out_config(config, models, donor, tuple(origins), tensors),
        tokenizer_files=_tokenizer_hashes(models, tokenizer_donor, blobs),
        tokenizer_blobs=blobs,
        vocab=built.alignment if built else None,
        vocab_digest=built.digest if built else "",
    )
    return replace(plan, fingerprint=compute_fingerprint(plan))


def _input_files(models: Mapping[str, ModelInput]) -> dict[str, tuple[tuple[str, int, str], ...]]:
    """(name, size, identity) of every input file, adapters' under their own key."""
    files = {}
    for key, m in sorted(models.items()):
        files[key] = tuple((f.name, f.size, f.identity) for f in m.files)
        if m.adapter is not None:
            files[adapter_key(key)] = tuple((f.name, f.size, f.identity) for f in m.adapter.files)
    return files


def _model_dirs(models: Mapping[str, ModelInput]) -> dict[str, str]:
    dirs = {}
    for key, m in models.items():
        dirs[key] = str(m.directory)
        if m.adapter is not None:
            dirs[adapter_key(key)] = str(m.adapter.directory)
    return dirs


def _build_tokenizer(config: MergeConfig, spec: TokenizerSpec, models: Mapping[str, ModelInput]) -> BuiltTokenizer:
    """The output tokenizer of ``spec`` from the inputs' tokenizer files, inputs in config order."""
    inputs = {}
    for ref in config.referenced_models():
        model = models[ref.key]
        inputs[ref.key] = VocabInput(ref.key, tokenizer_dir(model), _embed_rows(model))
    return build_tokenizer(spec, inputs, config.base_model.key if config.base_model else None)


def _embed_rows(model: ModelInput) -> int:
    """Rows of the model's token embedding (its vocabulary as the weights see it)."""
    for name, found in sorted(model.tensors.items()):
        if is_input_embedding(name) and found.entry.shape:
            return found.entry.shape[0]
    vocab = model.config.get("vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    raise ModelInputError(f"{model.ref.key} has no token embedding and no vocab_size in config.json",
                          path=str(model.directory), hint="a tokenizer can only be built for language models")


def _tokenizer_output(
    config: MergeConfig,
    spec: TokenizerSpec,
    built: BuiltTokenizer | None,
    donor: str,
    options: PlanOptions,
    models: Mapping[str, ModelInput],
) -> tuple[str | None, dict[str, bytes]]:
    """(model whose tokenizer files are copied, files whose bytes the plan makes)."""
    if built is not None:
        return None, dict(built.files)
    tokenizer_donor = _tokenizer_donor(donor, options)
    if tokenizer_donor is None:
        return None, {}
    model = models[tokenizer_donor]
    directory = tokenizer_dir(model)
    template = None
    if spec.chat_template is not None:
        template = resolve_chat_template(spec.chat_template, [tokenizer_dir(models[r.key])
                                                              for r in config.referenced_models()])
    if template is None and directory == model.directory:
        return tokenizer_donor, {}  # copied from the donor's folder when written
    # An adapter's tokenizer (its folder is not a model dir of the plan) or a changed template: the plan holds
    # the bytes. These are small files, read once here.
    files = [(name, (directory / name).read_bytes()) for name, _ in tokenizer_files(directory)]
    return tokenizer_donor, dict(apply_chat_template_files(files, template) if template else files)


def tokenizer_dir(model: ModelInput) -> Path:
    """Where ``model``'s tokenizer files are: its LoRA adapter's folder when that ships a tokenizer (a fine-tune's
    chat template and added tokens live there; mergekit's defect 5 dropped them), else the model's own."""
    if model.adapter is not None and model.adapter.has_tokenizer:
        return model.adapter.directory
    return model.directory


def _tokenizer_hashes(models: Mapping[str, ModelInput], donor: str | None,
                      blobs: Mapping[str, bytes]) -> tuple[tuple[str, str], ...]:
    if blobs:
        return tuple((name, hashlib.sha256(data).hexdigest()) for name, data in sorted(blobs.items()))
    return tokenizer_files(tokenizer_dir(models[donor])) if donor else ()


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
    vocab_rows: int | None = None,
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
        inputs.append(_input_ref(src.model.key, model, name, found))
    # Aligned vocabulary tensors may differ in rows (each model's own vocabulary), never in the other axes.
    shapes = {i.shape[1:] if vocab_rows is not None else i.shape for i in inputs}
    if len(shapes) > 1:
        listing = ", ".join(f"{i.model}: {list(i.shape)}" for i in inputs)
        vocab = is_input_embedding(out_name) or is_head(out_name)
        raise ModelInputError(
            f"Tensor size mismatch for {out_name}: {listing}",
            yaml_path=sl.yaml_path,
            tensor=out_name,
            hint=(
                "the vocabularies differ: align them with tokenizer_source: base (or union, or a model name)"
                if vocab
                else "these models have different architectures or sizes and cannot be merged tensor by tensor"
            ),
        )
    base_index = None
    if sl.base is not None:
        keys = [s.model.key for s in sl.sources]
        base_index = keys.index(sl.base.key) if sl.base.key in keys else None
    g_params, m_params = _resolve_params(out_name, in_names, sl, t, method, config, base_index)
    shape = inputs[0].shape if vocab_rows is None else (vocab_rows, *inputs[0].shape[1:])
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
        vocab_aligned=vocab_rows is not None,
    )


def _input_ref(key: str, model: ModelInput, name: str, found: TensorSource) -> InputRef:
    """Where input tensor ``name`` of ``model`` comes from, with its LoRA adapter's replacement or delta."""
    e = found.entry
    ref = InputRef(key, found.file, name, e.dtype, e.shape, e.start, e.end)
    adapter = model.adapter
    if adapter is None:
        return ref
    where = adapter_key(key)
    replaced = adapter.replacements.get(name)
    if replaced is not None:
        r = replaced.entry
        ref = InputRef(where, replaced.file, r.name, r.dtype, r.shape, r.start, r.end,
                       cast=e.dtype if r.dtype != e.dtype else None)
    target = adapter.targets.get(name)
    if target is not None:
        a, b = target.a, target.b
        lora = LoraRef(
            InputRef(where, a.file, a.entry.name, a.entry.dtype, a.entry.shape, a.entry.start, a.entry.end),
            InputRef(where, b.file, b.entry.name, b.entry.dtype, b.entry.shape, b.entry.start, b.entry.end),
            target.scale, target.fan_in_fan_out, target.embedding,
        )
        ref = replace(ref, lora=lora)
    return ref


def _edge_tensor(
    name: str,
    sl: _Slice,
    method: MethodSpec,
    config: MergeConfig,
    models: Mapping[str, ModelInput],
    built: BuiltTokenizer | None,
) -> TensorPlan:
    """A pre- or post-layer tensor: t = 0, taken from the slice's models, tied names standing in. With a built
    tokenizer, vocabulary tensors (embeddings, head) get the output vocabulary's rows."""
    in_names = []
    for src in sl.sources:
        have = models[src.model.key].tensors
        if name in have:
            in_names.append(name)
            continue
        tied = next((alt for alt in TIED_NAMES.get(name, ()) if alt in have), None)
        in_names.append(tied or name)  # a missing tensor is reported by _tensor with the model's name
    vocab = built is not None and (is_input_embedding(name) or is_head(name))
    return _tensor(name, in_names, sl, 0.0, method, config, models, built.vocab_size if vocab and built else None)


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
    return inputs[base_index if base_index is not None else 0].value_dtype


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


def _tokenizer_donor(donor: str, options: PlanOptions) -> str | None:
    """Whose tokenizer files are copied when none is built: the config donor's, unless --no-copy-tokenizer."""
    return donor if options.copy_tokenizer else None
