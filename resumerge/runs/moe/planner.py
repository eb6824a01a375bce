"""Plan a mergekit-moe config as an ordinary frozen :class:`~resumerge.merge.plan.merge_plan.Plan`: every output
tensor is a journaled unit made by a registered pure method from the inputs' tensors (base tensors and expert
MLPs copied, renamed or stacked; routers computed), so the engine runs, journals and resumes it like any merge.

Pure with respect to weights: only config.json files, safetensors headers and tokenizer files are read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs import CODECS, CodecTable
from resumerge.inputs.model import ModelInput
from resumerge.inputs.safetensors_format import DTYPE_SIZES, numel
from resumerge.machine.torch_import import torch
from resumerge.merge.plan.gguftypes import type_notes
from resumerge.merge.plan.inputrefs import tensor_ref
from resumerge.merge.plan.merge_plan import InputRef, Plan, PlanOptions, TensorPlan, fingerprinted
from resumerge.merge.plan.outconfig import set_quantization
from resumerge.merge.plan.placing import Placing, place_files
from resumerge.merge.plan.sharding import assign_shards, output_naming, resolve_shard_size
from resumerge.outputs.containers import container_for
from resumerge.runs.moe import experts as expert_methods
from resumerge.runs.moe import routers
from resumerge.runs.moe.architectures import check_experts, choose_output
from resumerge.runs.moe.config import PROMPT_MODES, ExpertConfig, MoeConfig
from resumerge.runs.moe.outconfig import moe_config, not_power_of_two
from resumerge.runs.moe.outkinds import OUTPUT_KINDS, OutputKind
from resumerge.runs.moe.tokenizer import tokenizer_blobs

METHOD = "moe"
DTYPE_CODES = MappingProxyType({"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                                "int64": "I64"})
_NAMES = MappingProxyType({code: name for name, code in DTYPE_CODES.items()})
EMBED = "model.embed_tokens.weight"

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EDGE = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_PARTS = ("gate_proj", "up_proj", "down_proj")


# What mergekit-moe names the output's copy of its config.
CONFIG_COPY = "mergekit_moe_config.yml"


def build_moe_plan(config: MoeConfig, models: Mapping[str, ModelInput], options: PlanOptions, *,
                   encoded: tuple[tuple[Any, Any], ...] | None = None, routers_key: str | None = None,
                   gates_preview: torch.Tensor | None = None, kinds: tuple[OutputKind, ...] = OUTPUT_KINDS,
                   codecs: CodecTable = CODECS, tokenizer_dir: Path | None = None) -> Plan:
    """Plan ``config`` over the opened ``models`` (keyed by ``ModelRef.key``); raises ``InputError`` subclasses
    for anything that would fail later. ``encoded`` holds each gated expert's tokenised (positive, negative)
    prompt sets for ``cheap_embed``; ``routers_key`` names the hidden-state modes' prompt forward pass (its content
    key: the plan's router tensors take its routers, and the fingerprint covers what they depend on), whose
    routers go to the last shard of their own (the merge runs beside the pass; see :mod:`.hiddenpass`);
    ``gates_preview`` the routers known now (``cheap_embed``'s, or a finished pass's), to warn about degenerate
    routing. ``kinds`` are the output architectures to choose from (:mod:`.outkinds`). Stored tensors are read in
    the formats ``codecs`` recognises (decoded before the experts see them). ``tokenizer_dir``: where the base's
    tokenizer files are, when not in its folder (a GGUF base's rebuilt folder)."""
    models = {key: m.recognised(codecs) for key, m in models.items()}
    choice = choose_output(config, models, kinds)
    kind = choice.kind
    check_experts(config, models)
    base = models[config.base_model.key]
    layers, hidden = int(base.config["num_hidden_layers"]), int(base.config["hidden_size"])
    out_name = config.dtype or _config_dtype(base.config)
    out_code = DTYPE_CODES.get(out_name or "")
    tensors: dict[str, TensorPlan] = {}
    for name in sorted(base.tensors):
        if _kept(kind, name, layers):
            tensors[name] = _copy(name, base, name, out_code)
    _check_base(kind, base, layers, tensors)
    _zero_fill(kind.zero_filled, base.config, layers, hidden, tensors, out_code or "F32")
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp"
        if kind.fused:
            tensors.update(_fused(prefix, layer, config.experts, models, out_code))
        else:
            for e, expert in enumerate(config.experts):
                for part in _PARTS:
                    name = f"{prefix}.experts.{e}.{part}.weight"
                    tensors[name] = _expert(name, expert, part, layer, models, out_code)
            for shared in config.shared_experts[:1]:
                for part in _PARTS:
                    name = f"{prefix}.{kind.shared_module}.{part}.weight"
                    tensors[name] = _expert(name, shared, part, layer, models, out_code)
        tensors.update(_routers(config, kind, layer, (layers, len(config.gated), hidden), base, options,
                                encoded, routers_key, out_code or "F32"))
        if kind.router_bias is not None:
            name, shape = f"{prefix}.{kind.router_bias}", (len(config.experts),)
            tensors[name] = _tensor(name, expert_methods.ZEROS, (), shape, "F32", params=(("shape", shape),))
    notes = list(choice.notes)
    power = not_power_of_two(len(config.experts))
    if power:
        notes.append(power)
    block = gates_preview
    if config.gate_mode in ("random", "uniform_random"):
        block = routers.random_block(config.gate_mode, options.random_seed, (layers, len(config.gated), hidden))
    degenerate = routers.degenerate_note(routers.degenerate_layers(block), layers) if block is not None else None
    if degenerate:
        notes.append(degenerate)
    late = {n for n, t in tensors.items() if t.method == routers.VALUES}
    options = resolve_shard_size(options, tensors)  # an hf:// OUT's default: sized from the output
    options, naming = output_naming(options, (f.name for f in base.files))
    shards, tensors = assign_shards(tensors, options.out_shard_size, last=late, naming=naming)
    out_config = moe_config(kind, base.config, experts=len(config.experts), shared=len(config.shared_experts),
                            per_token=config.experts_per_token, dtype=out_name if out_code else None)
    # Experts and copies are stored decoded (plainly): a quantized base's quantization_config would have
    # transformers read them as its format.
    set_quantization(out_config, base.config, tensors)
    # What the output's files are (one GGUF file, or gguf-split's files, holds its tokenizer), laid out.
    container = container_for(options)
    shards, tensors, container = place_files(container, shards, tensors,
                                             Placing(out_config, models, [config.base_model.key], last=late,
                                                     unit_size=options.out_shard_size))
    notes.extend(type_notes(tensors))  # where a GGUF is written in another type than llama.cpp's quantizer picks
    blobs = (tokenizer_blobs(tokenizer_dir or base.directory) if options.copy_tokenizer
             and not container.self_contained else {})
    inputs = {key: tuple((f.name, f.size, f.identity) for f in m.files) for key, m in sorted(models.items())}
    dirs = {key: str(m.directory) for key, m in models.items()}
    plan = Plan(
        method=METHOD,
        tensors=tensors,
        shards=shards,
        donor=config.base_model.key,
        tokenizer_donor=config.base_model.key if blobs else None,
        num_layers=layers,
        layer_origins=tuple((config.base_model.key, i) for i in range(layers)),
        inputs=inputs,
        model_dirs=dirs,
        options=options,
        out_config=out_config,
        tokenizer_files=tuple((n, hashlib.sha256(d).hexdigest()) for n, d in sorted(blobs.items())),
        tokenizer_blobs=blobs,
        container=container,
        notes=tuple(notes),
        units=(*routers.UNITS, *expert_methods.UNITS),
        config_copy=CONFIG_COPY,
    )
    return fingerprinted(plan)


def _config_dtype(cfg: Mapping[str, Any]) -> str | None:
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return value if isinstance(value, str) else None


def _kept(kind: OutputKind, name: str, layers: int) -> bool:
    if ".mlp." in name:
        return False
    if name in _EDGE:
        return True
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) < layers and m.group(2) in kind.kept


def _check_base(kind: OutputKind, base: ModelInput, layers: int, tensors: Mapping[str, TensorPlan]) -> None:
    """Every tensor the output needs from the base is there (lm_head only when the base has one)."""
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    needed += [f"model.layers.{i}.{suffix}" for i in range(layers) for suffix in sorted(kind.required())]
    for name in needed:
        if name not in tensors:
            raise ModelInputError(f"Tensor {name} required but not present in model {base.ref.key}",
                                  yaml_path="base_model", tensor=name)


def _ref(model: ModelInput, name: str, where: str) -> InputRef:
    found = model.tensors.get(name)
    if found is None:
        raise ModelInputError(f"Tensor {name} required but not present in model {model.ref.key}", yaml_path=where,
                              tensor=name)
    return tensor_ref(model.ref.key, model, name)


def _tensor(name: str, method: str, inputs: tuple[InputRef, ...], shape: tuple[int, ...], out_code: str,
            *, model_params: tuple[tuple[tuple[str, Any], ...], ...] = (),
            params: tuple[tuple[str, Any], ...] = ()) -> TensorPlan:
    return TensorPlan(name=name, shard="", method=method, inputs=inputs, base_index=None,
                      model_params=model_params or tuple(() for _ in inputs), params=params, shape=shape,
                      compute_dtype=None, out_dtype=out_code, nbytes=numel(shape) * DTYPE_SIZES[out_code])


def _copy(out: str, model: ModelInput, name: str, out_code: str | None,
          params: tuple[tuple[str, Any], ...] = (), where: str = "base_model") -> TensorPlan:
    ref = _ref(model, name, where)
    code = out_code or ref.value_dtype
    if not params and _NAMES[code] in expert_methods.FLOAT_NAMES:  # nothing drawn or scaled: a cast alone
        return _tensor(out, expert_methods.COPY_PLAIN, (ref,), ref.value_shape, code,
                       params=(("dtype", _NAMES[code]),))
    return _tensor(out, expert_methods.COPY, (ref,), ref.value_shape, code, model_params=(params,))


def _expert_params(expert: ExpertConfig, part: str) -> tuple[tuple[str, Any], ...]:
    params: dict[str, Any] = {}
    if expert.noise_scale is not None:
        params["noise_scale"] = expert.noise_scale
    if part == "down_proj" and expert.residual_scale is not None:
        params["residual_scale"] = expert.residual_scale
    return tuple(sorted(params.items()))


def _expert(out: str, expert: ExpertConfig, part: str, layer: int, models: Mapping[str, ModelInput],
            out_code: str | None) -> TensorPlan:
    name = f"model.layers.{layer}.mlp.{part}.weight"
    return _copy(out, models[expert.model.key], name, out_code, _expert_params(expert, part),
                 f"{expert.yaml_path}.source_model")


def _fused(prefix: str, layer: int, experts: tuple[ExpertConfig, ...], models: Mapping[str, ModelInput],
           out_code: str | None) -> dict[str, TensorPlan]:
    """transformers' fused pair of one layer: ``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj``
    (E, H, I)."""
    out = {}
    for part, names in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
        refs, params = [], []
        for expert in experts:
            for source in names:
                refs.append(_ref(models[expert.model.key], f"model.layers.{layer}.mlp.{source}.weight",
                                 f"{expert.yaml_path}.source_model"))
                params.append(_expert_params(expert, source))
        if len({r.value_shape for r in refs}) != 1:
            listing = ", ".join(f"{r.model}: {list(r.value_shape)}" for r in refs)
            raise ModelInputError(f"the experts' MLP sizes differ in layer {layer}: {listing}", yaml_path="experts")
        rows, cols = refs[0].value_shape
        shape = (len(experts), rows * len(names), cols)
        code = out_code or refs[0].value_dtype
        method = expert_methods.FUSED if any(params) else expert_methods.FUSED_COPIES  # noise or residual scale
        out[f"{prefix}.experts.{part}_proj"] = _tensor(f"{prefix}.experts.{part}_proj", method,
                                                       tuple(refs), shape, code, model_params=tuple(params),
                                                       params=(("dtype", _NAMES[code]), ("part", part)))
    return out


def _zero_fill(biases: tuple[str, ...], cfg: Mapping[str, Any], layers: int, hidden: int,
               tensors: dict[str, TensorPlan], out_code: str) -> None:
    """Zero attention ``biases`` (q/k/v) where the base has none (Qwen2-MoE requires them), sized as mergekit
    sizes them."""
    if not biases:
        return
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = hidden // heads
    for layer in range(layers):
        for bias in biases:
            name = f"model.layers.{layer}.{bias}"
            if name not in tensors:
                shape = ((heads if bias.startswith("self_attn.q") else kv) * head_dim,)
                tensors[name] = _tensor(name, expert_methods.ZEROS, (), shape, out_code,
                                        params=(("shape", shape),))


def _routers(config: MoeConfig, kind: OutputKind, layer: int, block: tuple[int, int, int], base: ModelInput,
             options: PlanOptions, encoded: tuple[tuple[Any, Any], ...] | None, routers_key: str | None,
             out_code: str) -> dict[str, TensorPlan]:
    """The router tensors of one layer: ``mlp.gate.weight`` (routed experts) and, for a kind with a
    ``shared_gate``, ``mlp.shared_expert_gate.weight`` (the shared expert's row)."""
    count, hidden = len(config.experts), block[2]
    rows = {f"model.layers.{layer}.mlp.gate.weight": (0, count)}
    if kind.shared_gate:
        rows[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] = (count, count + 1)
    out = {}
    params: tuple[tuple[str, Any], ...]
    for name, (first, stop) in rows.items():
        shape = (stop - first, hidden)
        if config.gate_mode in ("random", "uniform_random"):
            params = (("block", block), ("first", first), ("layer", layer), ("mode", config.gate_mode),
                      ("seed", options.random_seed), ("stop", stop))
            out[name] = _tensor(name, routers.RANDOM, (), shape, out_code, params=params)
        elif config.gate_mode == "cheap_embed":
            assert encoded is not None
            embed = _ref(base, EMBED, "base_model")
            params = (("first", first), ("sets", encoded), ("stop", stop))
            out[name] = _tensor(name, routers.CHEAP_EMBED, (embed,), shape, out_code, params=params)
        else:
            assert config.gate_mode in PROMPT_MODES and routers_key is not None
            params = (("first", first), ("hidden", hidden), ("layer", layer), ("routers", routers_key),
                      ("stop", stop))
            out[name] = _tensor(name, routers.VALUES, (), shape, out_code, params=params)
    return out
