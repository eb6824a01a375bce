"""Open a mergekit-moe config's models (config.json and headers only, local or hub, as any merge opens them),
run the prompt forward pass when the gate mode needs it, and plan it: the MoE counterpart of the session's
``prepare``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from resumerge.config.locations import state_root
from resumerge.errors import InputError
from resumerge.inputs.catalog import Inputs, open_inputs
from resumerge.moe.config import MoeConfig
from resumerge.moe.planner import build_moe_plan
from resumerge.plan.merge_plan import Plan, PlanOptions

if TYPE_CHECKING:
    from resumerge.inputs.hub import ProgressCallback

HIDDEN_MODES = frozenset({"hidden", "hidden_avg", "hidden_last"})


def prepare_moe(config: MoeConfig, options: PlanOptions, *, model_dirs: Mapping[str, str] | None = None,
                state_dir: str | os.PathLike[str] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                on_progress: ProgressCallback | None = None, forward: bool = True) -> tuple[Plan, Inputs]:
    """The plan of ``config`` and its opened inputs. No weight is read, except by the prompt forward pass of the
    hidden-state gate modes, which runs (or is found finished in the state dir) only when ``forward`` and after
    every check. Raises ``InputError`` subclasses."""
    inputs = open_inputs(config.as_merge_config(), model_dirs=model_dirs, state_dir=state_dir, cache_dir=cache_dir,
                         on_progress=on_progress)
    encoded = None
    if config.gate_mode in ("cheap_embed", *HIDDEN_MODES):
        encoded = encode_prompts(config, inputs)
    gates = preview = None
    if config.gate_mode == "cheap_embed" and forward and config.base_model.key not in inputs.hub:
        build_moe_plan(config, inputs.models, options, encoded=encoded)  # every check, before reading a weight
        preview = _cheap_embed_gates(config, inputs, encoded)
    if config.gate_mode in HIDDEN_MODES:
        build_moe_plan(config, inputs.models, options)  # every check, before the pass reads any weight
        if forward:
            gates = _hidden_gates(config, inputs, encoded, state_dir)
    return build_moe_plan(config, inputs.models, options, encoded=encoded, hidden_gates=gates,
                          gates_preview=preview), inputs


def encode_prompts(config: MoeConfig, inputs: Inputs) -> tuple[tuple[Any, Any], ...]:
    """Each gated expert's (positive, negative or None) prompt sets, tokenised with the base's tokenizer."""
    from resumerge.moe.prompts import encode, load_tokenizer

    tokenizer = load_tokenizer(inputs.models[config.base_model.key].directory, config.gate_mode)
    return tuple((encode(tokenizer, e.positive_prompts or ()),
                  encode(tokenizer, e.negative_prompts) if e.negative_prompts else None) for e in config.gated)


def _cheap_embed_gates(config: MoeConfig, inputs: Inputs, encoded: Any) -> torch.Tensor:
    """The ``cheap_embed`` routers of every layer (one read of the base's embedding), for the degenerate-routing
    warning."""
    from resumerge.inputs.source import InputSources
    from resumerge.moe.routers import cheap_embed_rows

    base = inputs.models[config.base_model.key]
    found = base.tensors["model.embed_tokens.weight"]
    e = found.entry
    sources = InputSources.local({base.ref.key: str(base.directory)})
    try:
        embed = sources.read(base.ref.key, found.file, e.start, e.end, e.dtype, e.shape)
        return cheap_embed_rows(embed, encoded, int(base.config["num_hidden_layers"]))
    finally:
        sources.close()


def _hidden_gates(config: MoeConfig, inputs: Inputs, encoded: Any,
                  state_dir: str | os.PathLike[str] | None) -> torch.Tensor:
    """The routers of the hidden-state modes ``(layers, gated experts, hidden)``: computed by the forward pass
    in the state dir (or found there, finished by an earlier run)."""
    from safetensors.torch import load_file

    from resumerge.moe.forward import hidden_routers, routers_key

    if config.base_model.key in inputs.hub:
        raise InputError("hidden-state gate modes read the base model's weights while planning; a hub base model "
                         "is not supported for them yet", yaml_path="base_model",
                         hint="download the base model and give its local path, or use cheap_embed or random gates")
    base = inputs.models[config.base_model.key]
    workdir = state_root(state_dir) / "moe-routers" / routers_key(base, config.gate_mode, encoded)
    data = load_file(str(hidden_routers(base, config.gate_mode, encoded, workdir)))
    return torch.stack([data[f"layers.{i}"] for i in range(len(data))])


