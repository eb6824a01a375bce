"""Plan an extraction: open FT and BASE (headers only), choose the modules, and freeze a :class:`Plan` of the adapter.

The plan is the same kind a merge has, so the session path runs it unchanged: one shard,
``adapter_model.safetensors``, whose tensors are the LoRA factors (``lora_extract_a``/``_b`` from BASE and FT; A
and B of a module side by side in the data order), the bias deltas, and FT's tensors saved whole
(``lora_extract_saved``, streamed in row chunks); its side files are ``adapter_config.json`` and ``README.md``,
made here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

import yaml

import resumerge.runs.extract.factors as registered  # the extraction's unit functions
from resumerge.config.locations import StateDir
from resumerge.config.merge_config import load_config_text
from resumerge.config.modelref import parse_model_ref
from resumerge.errors import ResumergeError, UsageError
from resumerge.inputs.catalog import Inputs, adapter_key, open_inputs
from resumerge.inputs.codecs import CODECS, CodecTable
from resumerge.inputs.hub import HubEvent
from resumerge.inputs.model import ModelInput
from resumerge.inputs.safetensors_format import DTYPE_SIZES, layout_shard, numel
from resumerge.merge.plan.inputrefs import tensor_ref
from resumerge.merge.plan.merge_plan import InputRef, Plan, PlanOptions, ShardPlan, TensorPlan, fingerprinted
from resumerge.merge.plan.planner import threads_matter
from resumerge.merge.plan.truncation import leading_rows
from resumerge.outputs.containers import PeftAdapter
from resumerge.runs.extract.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD, adapter_config, model_card
from resumerge.runs.extract.decompose import full_svd
from resumerge.runs.extract.modules import LoraModule, ModuleChoice, choose_modules
from resumerge.runs.extract.spec import EXTRACTION_METHOD, ExtractSpec

METHOD = EXTRACTION_METHOD
# The places in the config open_pair writes for the user, and the flags they stand for (an error names the flag).
_FLAG_OF = MappingProxyType({"models[0]": "--model", "models[1]": "--base-model", "base_model": "--base-model"})
_PROMOTE = MappingProxyType({"F64": 3, "F32": 2, "BF16": 1, "F16": 1})


def check_spec(spec: ExtractSpec) -> None:
    """Refuse options that cannot work, before any model is opened."""
    if spec.max_rank < 1:
        raise UsageError(f"--max-rank must be at least 1, got {spec.max_rank}")
    if spec.sv_epsilon < 0:
        raise UsageError(f"--sv-epsilon must not be negative, got {spec.sv_epsilon}")
    for text, flag in ((spec.model, "--model"), (spec.base_model, "--base-model")):
        try:
            parse_model_ref(text)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    if parse_model_ref(spec.model).key == parse_model_ref(spec.base_model).key:
        raise UsageError("--model and --base-model are the same model: there is nothing to extract")


def open_pair(spec: ExtractSpec, *, model_dirs: Mapping[str, str] | None = None,
              state: StateDir | None = None, cache_dir: str | os.PathLike[str] | None = None,
              on_progress: Callable[[HubEvent], None] | None = None) -> tuple[Inputs, str, str]:
    """Open BASE and FT (config.json and headers; hub ids resolved or streamed as for merges); returns the inputs
    and the keys of FT and BASE."""
    check_spec(spec)
    doc = {"merge_method": "passthrough", "base_model": spec.base_model,
           "models": [{"model": spec.model}, {"model": spec.base_model}]}
    try:
        config = load_config_text(yaml.safe_dump(doc, sort_keys=False), source="extraction")
        inputs = open_inputs(config, model_dirs=model_dirs, state=state, cache_dir=cache_dir,
                             on_progress=on_progress)
    except ResumergeError as exc:
        exc.yaml_path = _FLAG_OF.get((exc.yaml_path or "").split(".")[0], exc.yaml_path)
        raise
    return inputs, parse_model_ref(spec.model).key, parse_model_ref(spec.base_model).key


def build_extraction_plan(spec: ExtractSpec, inputs: Inputs, ft_key: str, base_key: str,
                          options: PlanOptions, codecs: CodecTable = CODECS) -> Plan:
    """The frozen plan of ``spec`` over the opened models (pure: headers only), their stored tensors read in the
    formats ``codecs`` recognises (a quantized BASE or FT is decoded before the task vector is taken)."""
    ft, base = inputs.models[ft_key].recognised(codecs), inputs.models[base_key].recognised(codecs)
    choice = choose_modules(spec, ft, base, truncate=options.unsafe_truncate_embeddings)
    if not choice.lora and not choice.saved:
        raise UsageError("nothing to extract: every module is excluded")
    source = _source_digest(inputs, ft_key, base_key)
    tensors: dict[str, TensorPlan] = {}
    for m in choice.lora:
        for tp in _lora_tensors(spec, m, ft, base, ft_key, base_key, source, options.random_seed, options.device):
            tensors[tp.name] = tp
    for out_name, name in choice.saved:
        ref = tensor_ref(ft_key, ft, name)
        tensors[out_name] = _tensor(out_name, registered.SAVED, (ref,), None, ((),), (), ref.value_shape,
                                    ref.value_dtype)
    if options.num_threads is not None and not threads_matter({t.method for t in tensors.values()}, registered.UNITS):
        options = replace(options, num_threads=None)  # as for merges: -j recorded only where the bytes follow it
    layout = layout_shard({n: (t.out_dtype, t.shape) for n, t in tensors.items()})
    shard = ShardPlan(ADAPTER_WEIGHTS, tuple(p.name for p in layout.order), layout.file_size)
    side = {ADAPTER_CONFIG: adapter_config(spec, choice)}
    if options.write_model_card:
        side[CARD] = model_card(spec, choice)
    plan = Plan(
        method=METHOD,
        tensors={n: replace(tensors[n], shard=ADAPTER_WEIGHTS) for n in sorted(tensors)},
        shards=(shard,),
        donor=ft_key,
        tokenizer_donor=None,
        num_layers=0,
        layer_origins=(),
        inputs=_input_files(inputs),
        model_dirs=_model_dirs(inputs),
        options=options,
        container=PeftAdapter(side),
        notes=choice.notes,
        units=registered.UNITS,
    )
    return fingerprinted(plan)


def module_choice(spec: ExtractSpec, inputs: Inputs, ft_key: str, base_key: str,
                  options: PlanOptions, codecs: CodecTable = CODECS) -> ModuleChoice:
    """The modules ``spec`` extracts (for estimates and rank probing), over the models' logical tensors."""
    return choose_modules(spec, inputs.models[ft_key].recognised(codecs), inputs.models[base_key].recognised(codecs),
                          truncate=options.unsafe_truncate_embeddings)


def module_seed(seed: int, module: str) -> int:
    """The randomized truncation's seed for ``module``: depends only on (seed, module name)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00lora\x00{module}".encode()).digest()[:8], "little") & (2**63 - 1)


def _lora_tensors(spec: ExtractSpec, m: LoraModule, ft: ModelInput, base: ModelInput, ft_key: str, base_key: str,
                  source: str, seed: int, device: str) -> list[TensorPlan]:
    refs: tuple[InputRef, ...] = (tensor_ref(base_key, base, m.weight), tensor_ref(ft_key, ft, m.weight))
    if m.keep_rows is not None:
        refs = tuple(leading_rows(r, m.keep_rows, yaml_path="") for r in refs)
    dtype = _common(refs)
    rows, cols = refs[0].value_shape
    out, inn = (cols, rows) if m.embedding else (rows, cols)
    params = (("device", device), ("distribute_scale", spec.distribute_scale), ("embedding", m.embedding),
              ("exact", spec.exact), ("module", m.name), ("rank", m.rank), ("seed", module_seed(seed, m.name)),
              ("source", source), ("sv_epsilon", spec.sv_epsilon), ("threads", registered.TRUNCATION_THREADS))
    kind, suffix = ("lora_embedding", "") if m.embedding else ("lora", ".weight")
    stem = f"base_model.model.{m.name}.{kind}"
    # The same computation either way; the exact truncation's units are admitted by its larger
    # workspace.
    full = full_svd(m.rank, out, inn, exact=spec.exact)
    method_a, method_b = ((registered.FACTOR_A_FULL, registered.FACTOR_B_FULL) if full
                          else (registered.FACTOR_A, registered.FACTOR_B))
    found = [
        _tensor(f"{stem}_A{suffix}", method_a, refs, 0, ((), ()), params, (m.rank, inn), dtype),
        _tensor(f"{stem}_B{suffix}", method_b, refs, 0, ((), ()), params, (out, m.rank), dtype),
    ]
    if m.bias is not None:
        brefs = (tensor_ref(base_key, base, m.bias), tensor_ref(ft_key, ft, m.bias))
        found.append(_tensor(f"base_model.model.{m.name}.lora_B.bias", registered.DELTA, brefs, 0, ((), ()), (),
                             brefs[1].value_shape, _common(brefs)))
    return found


def _tensor(name: str, method: str, inputs: tuple[InputRef, ...], base_index: int | None,
            model_params: tuple[tuple[tuple[str, object], ...], ...], params: tuple[tuple[str, object], ...],
            shape: tuple[int, ...], dtype: str) -> TensorPlan:
    return TensorPlan(name=name, shard="", method=method, inputs=inputs, base_index=base_index,
                      model_params=model_params, params=params, shape=shape, compute_dtype=None, out_dtype=dtype,
                      nbytes=numel(shape) * DTYPE_SIZES[dtype])


def _common(refs: tuple[InputRef, ...]) -> str:
    """The dtype FT − BASE has (torch's promotion of the two decoded dtypes)."""
    dtypes = {r.value_dtype for r in refs}
    if len(dtypes) == 1:
        return refs[0].value_dtype
    return max(dtypes, key=lambda d: _PROMOTE.get(d, 2)) if max(_PROMOTE.get(d, 2) for d in dtypes) > 1 else "F32"


def _source_digest(inputs: Inputs, *keys: str) -> str:
    """A digest of the weight files' identities of the models ``keys``."""
    files = _input_files(inputs)
    text = repr([(k, files.get(k), files.get(adapter_key(k))) for k in keys])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _input_files(inputs: Inputs) -> dict[str, tuple[tuple[str, int, str], ...]]:
    files = {}
    for key, m in sorted(inputs.models.items()):
        files[key] = tuple((f.name, f.size, f.identity) for f in m.files)
        if m.adapter is not None:
            files[adapter_key(key)] = tuple((f.name, f.size, f.identity) for f in m.adapter.files)
    return files


def _model_dirs(inputs: Inputs) -> dict[str, str]:
    dirs = {}
    for key, m in inputs.models.items():
        dirs[key] = str(m.directory)
        if m.adapter is not None:
            dirs[adapter_key(key)] = str(m.adapter.directory)
    return dirs
