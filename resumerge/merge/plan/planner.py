"""Build the frozen :class:`~resumerge.merge.plan.merge_plan.Plan` from a validated config and the inputs' headers.

Pure with respect to weights: only config.json files and safetensors headers are consulted, so every mistake
(layer ranges, slice lengths, missing parameters, method contracts, shape mismatches) is reported before any
weight is read or written. Layer renumbering, parameter precedence, the ``t`` rule and where embeddings and
final norm / lm_head come from follow mergekit (see ``shared/reference/mergekit-semantics.md`` §1.3, §3).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import chain

from resumerge.config.merge_config import MergeConfig, SourceConfig, UnknownKeyError, honest_unknown_key
from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs.catalog import adapter_key
from resumerge.inputs.codecs import CODECS, CodecTable
from resumerge.inputs.files import TensorSource
from resumerge.inputs.model import ModelInput
from resumerge.merge.methods.registry import BasePolicy, MethodSpec, get_method
from resumerge.merge.plan.accounting import Drops
from resumerge.merge.plan.architecture import (
    TIED_NAMES,
    Layout,
    check_architectures,
    infer_layout,
    is_head,
    is_input_embedding,
)
from resumerge.merge.plan.buildcheck import check_built
from resumerge.merge.plan.experts import mark_expert_stacks
from resumerge.merge.plan.filters import FilterTally
from resumerge.merge.plan.fusedscales import fused_notes, share_scales
from resumerge.merge.plan.ggufbudget import target_notes
from resumerge.merge.plan.grams import attach_grams
from resumerge.merge.plan.input_fates import account, stored_names_of
from resumerge.merge.plan.inputrefs import adapted_ref, refs_of
from resumerge.merge.plan.lorafactors import adapter_output, check_adapter_parents, factor_tensor, kept_at_base
from resumerge.merge.plan.merge_plan import (
    InputRef,
    Plan,
    PlanOptions,
    TensorPlan,
    fingerprinted,
    parts_bytes,
    stored_parts_of,
)
from resumerge.merge.plan.module_views import (
    DEFAULT,
    TEXT,
    VISION,
    inferred_views,
    module_names,
    module_views,
    set_vision_layers,
)
from resumerge.merge.plan.modules import plan_modules
from resumerge.merge.plan.mtp import MtpOutcome, plan_mtp
from resumerge.merge.plan.nonfloat import UNITS as NONFLOAT_UNITS
from resumerge.merge.plan.nonfloat import is_float, nonfloat_tensor, refuse_differing
from resumerge.merge.plan.outconfig import build_out_config, slice_path
from resumerge.merge.plan.outformat import copied, out_dtype, out_format, stored_codec
from resumerge.merge.plan.packing import OutLayer, cut_table, packed_tables, whole_stack
from resumerge.merge.plan.parameters import ParameterResolver, Resolved, checked_method, parameter_places
from resumerge.merge.plan.placing import Placing, place_files
from resumerge.merge.plan.quantnotes import quantization_notes
from resumerge.merge.plan.sharding import assign_shards, output_naming, resolve_shard_size
from resumerge.merge.plan.slices import Slice, check_slice, left_out, normalise
from resumerge.merge.plan.tensorkinds import TensorKinds, carried_companions, kind_key
from resumerge.merge.plan.tokenizer_plan import (
    build_output_tokenizer,
    refuse_other_tokenizers,
    tokenizer_dir,
    tokenizer_hashes,
    tokenizer_output,
)
from resumerge.merge.plan.truncation import common_rows, leading_rows, truncation_notes
from resumerge.merge.vocab import BuiltTokenizer, parse_tokenizer_spec, resolve_chat_template
from resumerge.outputs.containers import container_for

# Why a planner leaves input tensors out (resumerge.merge.plan.accounting).
NOT_IN_FIRST = "not in the layer of the slice's first model, whose names the output follows"
MTP_FROM_LAST = "MTP module: taken from the last slice's models"
MTP_DROPPED = "MTP module dropped: a model of the last slice has none"


@dataclass(frozen=True)
class _Ctx:
    """What planning one tensor needs besides its slice: the method, the config, the models, the tokenizer; and
    what the build collects on the way: each filter's matches, and why input tensors are left out."""

    method: MethodSpec
    config: MergeConfig
    models: Mapping[str, ModelInput]
    built: BuiltTokenizer | None
    truncate: bool
    dequantize: bool
    filters: FilterTally
    parameters: ParameterResolver
    drops: Drops = field(default_factory=Drops)
    # Worked out once per build: each kind of tensor's plan, each slice's sources (by the slice's id: it is held).
    kinds: TensorKinds = field(default_factory=TensorKinds)
    sources: dict[int, _Sources] = field(default_factory=dict)


@dataclass(frozen=True)
class _Sources:
    """A slice's sources as its tensors' inputs are made from them: each one's key, YAML path, logical tensors and
    references by name (:func:`~resumerge.merge.plan.inputrefs.refs_of`, LoRA adapters applied), and the base's
    position among them."""

    slice: Slice
    each: tuple[tuple[str, str, Mapping[str, TensorSource], Callable[[str], InputRef]], ...]
    base_index: int | None


def _sources(sl: Slice, ctx: _Ctx) -> _Sources:
    found = ctx.sources.get(id(sl))
    if found is not None and found.slice is sl:
        return found
    each = []
    for src in sl.sources:
        key = src.model.key
        model = ctx.models[key]
        ref = refs_of(key, model) if model.adapter is None else partial(adapted_ref, key, model)
        each.append((key, src.yaml_path, model.tensors, ref))
    keys = [key for key, *_ in each]
    base_index = keys.index(sl.base.key) if sl.base is not None and sl.base.key in keys else None
    found = ctx.sources[id(sl)] = _Sources(sl, tuple(each), base_index)
    return found


def build_plan(config: MergeConfig, models: Mapping[str, ModelInput], options: PlanOptions,
               codecs: CodecTable = CODECS) -> Plan:
    """Plan every output tensor of ``config`` over the opened ``models`` (keyed by ``ModelRef.key``), whose
    stored tensors are read in the formats ``codecs`` recognises (each input's codec and companions recorded on
    its :class:`InputRef`).

    Raises :class:`ConfigError` (with the YAML path) or :class:`ModelInputError` for anything that would fail
    later; returns a plan with its fingerprint set.
    """
    method = checked_method(config)
    models = _recognised(models, codecs)
    check_architectures(config, models, allow_crimes=options.allow_crimes)
    if method.factor_inputs:
        check_adapter_parents(config, models, method.name)
    elif options.out_adapter:
        raise ConfigError(f"--out-adapter writes a merge of LoRA adapters, which {method.name} is not",
                          yaml_path="merge_method", hint="use merge_method: core_space")
    layouts = _layouts(models)
    if config.base_model is not None and method.base is BasePolicy.FORBIDDEN:
        raise ConfigError(f"merge method {method.name} does not accept a base model", yaml_path="base_model")
    try:
        spec = parse_tokenizer_spec(config.tokenizer_source, config.tokenizer, config.chat_template)
    except UnknownKeyError as exc:
        raise honest_unknown_key(exc, config.text) from None
    if spec.builds:
        built: BuiltTokenizer | None = build_output_tokenizer(config, spec, models)
    else:  # one tokenizer copied over every model's rows: they must mean the same tokens
        refuse_other_tokenizers(config, models)
        built = None
    filters = FilterTally(parameter_places(config))
    ctx = _Ctx(method, config, models, built, options.unsafe_truncate_embeddings and built is None,
               options.dequantize, filters, ParameterResolver(config, filters))
    tensors: dict[str, TensorPlan] = {}
    notes = list(config.warnings)
    vision_layers = None
    if config.modules is not None:
        origins, vision_layers, mtp = _plan_module_form(ctx, layouts, tensors, notes)
    else:
        slices = normalise(config.models, config.slices, config.base_model, layouts)
        origins, mtp = _plan_stack(slices, layouts, ctx, tensors, notes)
    if config.models is not None:  # a VLM's vision tower, audio encoder, …: each module over its own layers
        sl = slices[0]
        keys = [src.model.key for src in sl.sources]
        tensors.update(plan_modules(
            keys, {k: layouts[k].other_modules for k in keys},
            lambda name, names, t: _tensor(name, names, sl, t, ctx), yaml_path="models",
        ))
    ctx.filters.refuse_unmatched(chain(tensors, *(stored_names_of(m) for m in models.values())))
    refuse_differing(tensors, {key: m.directory for key, m in models.items()})
    tensors = mark_expert_stacks(tensors, models[_donor(config)].config)
    tensors = {name: out_format(tp, dequantize=options.dequantize) for name, tp in tensors.items()}
    tensors = share_scales(tensors)  # fused q/k/v, gate/up: one tensor-wide scale each (NVFP4)
    if method.factor_inputs:  # core_space: each adapted tensor from the base and the adapters' factor pairs
        tensors = {name: factor_tensor(tp) for name, tp in tensors.items()}
        notes.extend(kept_at_base(config, models, method.name))
    grams = None
    if method.gram_inputs:  # regmean: each linear weight with every model's measured Gram (resumerge.merge.plan.grams)
        tensors, grams = attach_grams(tensors, models, method.name)
        notes.extend(grams.notes)
    if ctx.truncate:
        notes.extend(truncation_notes(tensors, models))
    options = resolve_shard_size(options, tensors)  # an hf:// OUT's default: sized from the output
    donor = _donor(config)
    options, naming = output_naming(options, (f.name for f in models[donor].files))
    shards, tensors = assign_shards(tensors, options.out_shard_size, naming=naming)
    cut_rows = _embed_rows(tensors) if ctx.truncate and notes else None
    # Chosen once: what the output's files are (a GGUF holds its tokenizer: no tokenizer files beside it).
    container = container_for(options)
    tokenizer_donor, blobs = (None, {}) if container.self_contained else tokenizer_output(
        config, spec, built, donor, options, models, cut_rows)
    out_config = build_out_config(config, models, donor, tuple(origins), tensors, mtp=mtp)
    if vision_layers is not None:
        set_vision_layers(out_config, vision_layers)
    notes.extend(check_built(out_config, {k: m.config for k, m in models.items()}, donor, tuple(origins), tensors,
                             lambda i: slice_path(config, i)))
    order = [donor, *(r.key for r in config.referenced_models() if r.key != donor)]

    def template() -> str | None:  # asked only by a container holding the tokenizer: the config's chat template
        return None if spec.chat_template is None else resolve_chat_template(
            spec.chat_template, [tokenizer_dir(models[key]) for key in order])

    shards, tensors, container = place_files(container, shards, tensors,
                                             Placing(out_config, models, order, template,
                                                     unit_size=options.out_shard_size, name=config.name))
    notes.extend(quantization_notes(tensors))
    notes.extend(fused_notes(tensors))
    if options.imatrix_texts is not None:  # the run's own work before the encoding: said before it starts
        notes.append(f"the importance matrix is computed on the merge from the texts of "
                     f"{os.path.basename(options.imatrix_texts)} (--imatrix-texts) before the GGUF is encoded: a "
                     "forward pass over the merge never written, one decoder layer at a time, journaled")
        notes.extend(target_notes(options))
    if options.num_threads is not None and not threads_matter({method.name, *(t.method for t in tensors.values())}):
        options = replace(options, num_threads=None)
    plan = Plan(
        method=method.name,
        tensors=tensors,
        shards=shards,
        donor=donor,
        tokenizer_donor=tokenizer_donor,
        num_layers=len(origins),
        layer_origins=tuple(origins),
        inputs=_input_files(models) | (grams.files if grams else {}),
        model_dirs=_model_dirs(models) | (grams.dirs if grams else {}),
        options=options,
        out_config=out_config,
        tokenizer_files=tokenizer_hashes(models, tokenizer_donor, blobs),
        tokenizer_blobs=blobs,
        container=container,
        vocab=built.alignment if built else None,
        vocab_digest=built.digest if built else "",
        notes=tuple(notes),
        input_roles={key: m.formats.role_counts() for key, m in models.items() if m.formats is not None},
        units=NONFLOAT_UNITS,
        filters=ctx.filters.matches(),
        accounting=account(tensors, models, ctx.drops),
    )
    return fingerprinted(adapter_output(plan, config) if options.out_adapter else plan)


def _recognised(models: Mapping[str, ModelInput], codecs: CodecTable) -> dict[str, ModelInput]:
    """Each of ``models`` recognised under ``codecs`` (:meth:`ModelInput.recognised`), once for models stored
    alike."""
    done: list[ModelInput] = []
    for m in models.values():
        done.append(m.recognised(codecs, seen=done))
    return dict(zip(models, done))


def _layouts(models: Mapping[str, ModelInput]) -> dict[str, Layout]:
    """Each model's layout: inferred once for models with equal configs and the same logical tensor names (all
    :func:`infer_layout` reads)."""
    layouts: dict[str, Layout] = {}
    for key, m in models.items():
        twin = next((k for k in layouts if models[k].config == m.config
                     and models[k].tensors.keys() == m.tensors.keys()), None)
        layouts[key] = layouts[twin] if twin is not None else infer_layout(m.tensors, m.config, where=str(m.directory))
    return layouts


def _plan_stack(slices: list[Slice], layouts: Mapping[str, Layout], ctx: _Ctx, tensors: dict[str, TensorPlan],
                notes: list[str]) -> tuple[list[tuple[str, int]], MtpOutcome | None]:
    """Plan ``slices`` over one stack of layers (``layouts``: each model's, or each model's module) into
    ``tensors``; return the (model, source layer) of each output layer and what became of the inputs' MTP modules
    (whose note goes to ``notes``). Loose tensors before the layers come from the first slice's models, the others
    and the MTP module (see :mod:`resumerge.merge.plan.mtp`) from the last slice's."""
    origins: list[tuple[str, int]] = []
    placed: list[OutLayer] = []
    left_out(slices, layouts, ctx.drops)
    for s_index, sl in enumerate(slices):
        check_slice(sl, ctx.method, layouts)
        length = sl.ranges[0][1] - sl.ranges[0][0]
        first = layouts[sl.sources[0].model.key]
        for k in range(length):
            t = 1.0 if length == 1 else k / (length - 1)
            out_layer = len(origins)
            origins.append((sl.sources[0].model.key, sl.ranges[0][0] + k))
            placed.append(OutLayer(sl, tuple(start + k for start, _ in sl.ranges), t))
            for src, rng in zip(sl.sources[1:], sl.ranges[1:]):  # names follow the slice's first model
                layout = layouts[src.model.key]
                extra = set(layout.suffixes_of(rng[0] + k)) - set(first.suffixes_of(sl.ranges[0][0] + k))
                ctx.drops.add(src.model.key, (layout.layer_name(rng[0] + k, x) for x in extra), NOT_IN_FIRST)
            out_start = first.layer_start(out_layer)
            starts = [layouts[src.model.key].layer_start(rng[0] + k) for src, rng in zip(sl.sources, sl.ranges)]
            for suffix in first.suffixes_of(sl.ranges[0][0] + k):  # MoE dense layers have no experts
                tensors[out_start + suffix] = _tensor(out_start + suffix, [s + suffix for s in starts], sl, t, ctx)
        if s_index == 0:
            # Pre-layer names of every source: one that some model lacks is reported, never dropped.
            pre = sorted({n for src in sl.sources for n in layouts[src.model.key].pre})
            for name in pre:
                tensors[name] = _edge_tensor(name, sl, ctx)
    last = slices[-1]
    post_names: list[str] = []
    for src in last.sources:
        post_names.extend(n for n in layouts[src.model.key].post if n not in post_names)
    for name in post_names:
        tensors[name] = _edge_tensor(name, last, ctx)
    counts = {key: layout.num_layers for key, layout in layouts.items()}
    if not whole_stack(slices, counts):  # a table packed per layer takes each output layer's block (.packing)
        loose = {n for layout in layouts.values() for n in (*layout.pre, *layout.post)}
        for name, packing in packed_tables(ctx.models[_donor(ctx.config)].config).items():
            if name in tensors and name in loose:
                tensors[name] = cut_table(name, packing, placed, counts, partial(_layer_table, name, ctx))
    keys = [src.model.key for src in last.sources]
    planned, mtp = plan_mtp(keys, {k: layouts[k].mtp for k in layouts}, len(origins),
                            {k: layouts[k].num_layers for k in keys},
                            lambda out, names, vocab: _mtp_tensor(out, names, vocab, last, ctx))
    tensors.update(planned)
    for key, layout in layouts.items():  # the supplying models' modules are read: only the others' are left out
        ctx.drops.add(key, layout.mtp.names() if layout.mtp else (), MTP_DROPPED if mtp and not mtp.count
                      else MTP_FROM_LAST)
    notes.extend(n for n in [mtp.note if mtp else ""] if n)
    return origins, mtp


def _plan_module_form(ctx: _Ctx, layouts: Mapping[str, Layout], tensors: dict[str, TensorPlan],
                      notes: list[str]) -> tuple[list[tuple[str, int]], int, MtpOutcome | None]:
    """Plan a ``modules:`` config, module by module in mergekit's order, each with its own layer numbering;
    a module the config does not list is copied unchanged from the donor (and ``notes`` says so). Returns the
    language model's layer origins, the output's vision layer count and the language model's MTP outcome."""
    config = ctx.config
    donor = _donor(config)
    order, names, listed = module_names(config, layouts[donor])
    inferred = DEFAULT in order
    views = {key: (inferred_views if inferred else module_views)(layout, key, yaml_path="modules")
             for key, layout in layouts.items()}
    text: list[tuple[str, int]] = []
    vision, text_mtp = 0, None
    for name in order:
        module, own = listed.get(name), {key: view[name] for key, view in views.items()}
        if module is None:
            ref = next(r for r in config.referenced_models() if r.key == donor)
            path = f"modules.{names[name]}"
            for key in own.keys() - {donor}:
                ctx.drops.add(key, own[key].names(), f"module {names[name]} not listed: copied from {donor}")
            copy = Slice((SourceConfig(ref, None, {}, path),), ((0, own[donor].num_layers),), None, {}, path)
            passthrough = get_method("passthrough")
            assert passthrough is not None
            origins, mtp = _plan_stack([copy], own, replace(ctx, method=passthrough, truncate=False), tensors, notes)
            notes.append(f"module {names[name]} is not listed under modules: it is copied unchanged from {donor}")
        else:
            slices = normalise(module.models, module.slices, config.base_model, own,
                                root=module.yaml_path, module_parameters=module.parameters)
            origins, mtp = _plan_stack(slices, own, ctx, tensors, notes)
        if name == TEXT:
            text, text_mtp = origins, mtp
        elif name == VISION:
            vision = len(origins)
    return text, vision, text_mtp


def _embed_rows(tensors: Mapping[str, TensorPlan]) -> int | None:
    """Rows of the output's token embedding (else its head), or None without either."""
    for name in sorted(tensors):
        if (is_input_embedding(name) or is_head(name)) and len(tensors[name].shape) == 2:
            return tensors[name].shape[0]
    return None


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


def _tensor(out_name: str, in_names: list[str], sl: Slice, t: float, ctx: _Ctx, vocab_rows: int | None = None,
            *, keep_rows: int | None = None) -> TensorPlan:
    """The plan of output tensor ``out_name`` of ``sl`` at layer position ``t`` over the inputs ``in_names`` (one
    per source), with ``vocab_rows`` rows of the built vocabulary, or the inputs' ``keep_rows`` leading rows. Worked
    out whole for the first tensor of its kind, made from the kind for the others (:mod:`.tensorkinds`); raises
    ModelInputError for a missing input or inputs whose shapes differ."""
    sources = _sources(sl, ctx)
    inputs = []
    for (key, where, have, ref), name in zip(sources.each, in_names):
        if name not in have:
            raise ModelInputError(f"Tensor {name} required but not present in model {key}", yaml_path=where,
                                  tensor=name)
        found = ref(name)
        inputs.append(found if keep_rows is None else leading_rows(found, keep_rows, yaml_path=where))
    method, config, base_index = ctx.method, ctx.config, sources.base_index
    kind_of = kind_key(method.name, base_index, vocab_rows, inputs)
    kinds = ctx.kinds.get(kind_of) if kind_of is not None else None
    if kinds is None:
        _check_shapes(out_name, inputs, sl, vocab_rows)
        nonfloat = not all(is_float(i.value_dtype) for i in inputs) and bool(
            len(inputs) > 1 or config.dtype or config.out_dtype)
        if kind_of is not None:
            kinds = ctx.kinds.checked(kind_of, nonfloat)
    else:
        nonfloat = kinds.nonfloat
    if nonfloat:
        return nonfloat_tensor(out_name, inputs, base_index, ctx.drops)
    g_params, m_params = ctx.parameters.resolve(method, sl, out_name, in_names, t, base_index)
    kind = kinds.get(g_params, m_params) if kinds is not None else None
    if kind is not None:
        return kind.plan(out_name, tuple(inputs))
    tp = _planned(out_name, inputs, base_index, (g_params, m_params), ctx, vocab_rows)
    if kinds is not None:
        kinds.add(tp)
    return tp


def _layer_table(name: str, ctx: _Ctx, out: OutLayer) -> TensorPlan:
    """Table ``name`` of ``out``'s slice merged as that slice merges the output layer (its ``t``)."""
    return _tensor(name, [name] * len(out.slice.sources), out.slice, out.t, ctx)


def _check_shapes(out_name: str, inputs: list[InputRef], sl: Slice, vocab_rows: int | None) -> None:
    # Aligned vocabulary tensors may differ in rows (each model's own vocabulary), never in the other axes.
    shapes = {i.value_shape[1:] if vocab_rows is not None else i.value_shape for i in inputs}
    if len(shapes) > 1:
        listing = ", ".join(f"{i.model}: {list(i.value_shape)}" for i in inputs)
        vocab = is_input_embedding(out_name) or is_head(out_name)
        raise ModelInputError(
            f"Tensor size mismatch for {out_name}: {listing}",
            yaml_path=sl.yaml_path,
            tensor=out_name,
            hint=(
                "the vocabularies differ: align them with tokenizer_source: base (or union, or a model name), or give "
                "one model the other's tokenizer first with resumerge tokensurgeon MODEL DONOR OUT"
                if vocab
                else "these models have different architectures or sizes and cannot be merged tensor by tensor"
            ),
        )


def _planned(out_name: str, inputs: list[InputRef], base_index: int | None, resolved: Resolved, ctx: _Ctx,
             vocab_rows: int | None) -> TensorPlan:
    """The whole planning of a float output tensor over ``inputs`` with its ``resolved`` parameters."""
    method, config = ctx.method, ctx.config
    g_params, m_params = resolved
    shape = inputs[0].value_shape if vocab_rows is None else (vocab_rows, *inputs[0].value_shape[1:])
    out_code = out_dtype(config, inputs, base_index)
    if config.out_dtype is None and method.half_result_float32 and out_code in ("F16", "BF16"):
        out_code = "F32"
    # Made in its stored format at once (what out_format makes of it): a 92k-tensor plan makes 46k of them.
    codec = stored_codec(inputs, base_index, dequantize=ctx.dequantize)
    carried = carried_companions(inputs, codec, base_index=base_index)
    tp = TensorPlan(
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
        nbytes=parts_bytes(stored_parts_of(out_name, out_code, shape, codec, carried)),
        vocab_aligned=vocab_rows is not None,
        out_codec=codec,
        carried=carried,
    )
    return tp if codec.plain else copied(tp)


def _edge_tensor(name: str, sl: Slice, ctx: _Ctx) -> TensorPlan:
    """A pre- or post-layer tensor: t = 0, taken from the slice's models, tied names standing in. With a built
    tokenizer, vocabulary tensors (embeddings, head) get the output vocabulary's rows; with ``truncate``
    (--unsafe-truncate-embeddings) they keep the inputs' common leading rows."""
    models, built, truncate = ctx.models, ctx.built, ctx.truncate
    in_names = []
    for src in sl.sources:
        have = models[src.model.key].tensors
        if name in have:
            in_names.append(name)
            continue
        tied = next((alt for alt in TIED_NAMES.get(name, ()) if alt in have), None)
        in_names.append(tied or name)  # a missing tensor is reported by _tensor with the model's name
    is_vocab = is_input_embedding(name) or is_head(name)
    vocab = built is not None and is_vocab
    keep = _kept_rows(models, sl, in_names) if truncate and is_vocab else None
    return _tensor(name, in_names, sl, 0.0, ctx, built.vocab_size if vocab and built else None, keep_rows=keep)


def _mtp_tensor(name: str, in_names: list[str], vocab: bool, sl: Slice, ctx: _Ctx) -> TensorPlan:
    """A tensor of the MTP module (:mod:`resumerge.merge.plan.mtp`): the last layer's t = 1, but its vocabulary copies
    (``vocab``) are planned as the embedding and head they copy are: t = 0, the output vocabulary's rows."""
    built = ctx.built if vocab else None
    keep = _kept_rows(ctx.models, sl, in_names) if vocab and ctx.truncate else None
    return _tensor(name, in_names, sl, 0.0 if vocab else 1.0, ctx, built.vocab_size if built else None, keep_rows=keep)


def _kept_rows(models: Mapping[str, ModelInput], sl: Slice, in_names: list[str]) -> int | None:
    found = [models[s.model.key].tensors.get(n) for s, n in zip(sl.sources, in_names)]
    return common_rows([f.entry.shape for f in found if f is not None])


def _donor(config: MergeConfig) -> str:
    # Deterministic, unlike mergekit's set-ordered choice (defect 1): base model, else the first model listed.
    if config.base_model is not None:
        return config.base_model.key
    if config.models:
        return config.models[0].model.key
    if config.slices:
        return config.slices[0].sources[0].model.key
    first = (config.modules or ())[0]
    return first.models[0].model.key if first.models else (first.slices or ())[0].sources[0].model.key


def threads_matter(methods: Iterable[str], units: Sequence[MethodSpec] = ()) -> bool:
    """True when the output of any of ``methods`` (built-in ones, or a kind's ``units``) depends on torch's thread
    count (see MethodSpec)."""
    return any(spec.thread_dependent for spec in (get_method(m, units) for m in methods) if spec is not None)
