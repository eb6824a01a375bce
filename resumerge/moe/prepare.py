"""Open a mergekit-moe config's models (config.json and headers only, local or hub, as any merge opens them)
and plan it: the MoE counterpart of the session's ``prepare``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from resumerge.inputs.catalog import Inputs, open_inputs
from resumerge.moe.config import MoeConfig
from resumerge.moe.planner import build_moe_plan
from resumerge.plan.merge_plan import Plan, PlanOptions

if TYPE_CHECKING:
    from resumerge.inputs.hub import ProgressCallback


def prepare_moe(config: MoeConfig, options: PlanOptions, *, model_dirs: Mapping[str, str] | None = None,
                state_dir: str | os.PathLike[str] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                on_progress: ProgressCallback | None = None) -> tuple[Plan, Inputs]:
    """The plan of ``config`` and its opened inputs; no weight is read. Raises ``InputError`` subclasses."""
    inputs = open_inputs(config.as_merge_config(), model_dirs=model_dirs, state_dir=state_dir, cache_dir=cache_dir,
                         on_progress=on_progress)
    encoded = None
    if config.gate_mode == "cheap_embed":
        encoded = encode_prompts(config, inputs)
    return build_moe_plan(config, inputs.models, options, encoded=encoded), inputs


def encode_prompts(config: MoeConfig, inputs: Inputs) -> tuple[tuple[Any, Any], ...]:
    """Each gated expert's (positive, negative or None) prompt sets, tokenised with the base's tokenizer."""
    from resumerge.moe.prompts import encode, load_tokenizer

    tokenizer = load_tokenizer(inputs.models[config.base_model.key].directory, config.gate_mode)
    return tuple((encode(tokenizer, e.positive_prompts or ()),
                  encode(tokenizer, e.negative_prompts) if e.negative_prompts else None) for e in config.gated)
