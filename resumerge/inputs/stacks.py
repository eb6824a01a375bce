"""The families whose decoder layers are no plain stack, and what each does with them instead (by config.json's model
type; for a family that loops layers as its config says, by that config): a stack of slices of one is refused naming
it (:mod:`resumerge.merge.plan.outconfig`: a slice of a loop is no model of its family), and so is a layer-by-layer
pass that cannot follow its forward (:mod:`resumerge.forward.engine.stream`; one that follows the forward's calls, a
loop's included, runs it: :mod:`resumerge.forward.engine.calls`), as it is for a model whose config makes it no causal
LM (:data:`NOT_CAUSAL_AS_CONFIGURED`: XLNet's ``attn_type: bi`` and XLM's ``causal: false``, their defaults; their
causal modes followed)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

NOT_A_STACK: Mapping[str, str] = MappingProxyType({
    "dory": "loops its middle layers (n_recurrent_layers, n_recurrent_loops times)",
    "hrm_text": "runs its two layer stacks in turn, in cycles",
    "zamba": "shares one transformer block across its hybrid layers",
    "zamba2": "shares its transformer blocks across its hybrid layers",
})

def _xlnet(config: Mapping[str, Any]) -> str | None:
    if config.get("attn_type", "bi") == "uni":
        return None
    return ("attends both ways unless its attn_type is uni (each position sees every token, the next one included: "
            "its logits are no next-token predictions)")


def _xlm(config: Mapping[str, Any]) -> str | None:
    if config.get("causal"):
        return None
    return ("attends both ways unless its config says causal (a masked LM: each position sees every token, the next "
            "one included: its logits are no next-token predictions)")


# families that are causal LMs or not as their config says (their defaults and published checkpoints are not: each
# position's logits read the tokens after it, so their NLL is no next-token loss): why a pass of one that is not is
# refused (None where it is)
NOT_CAUSAL_AS_CONFIGURED: Mapping[str, Callable[[Mapping[str, Any]], str | None]] = MappingProxyType({
    "xlnet": _xlnet,
    "xlm": _xlm,
})


def _loop(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """An Inkling 2 Loop config's looped layers' start and end and its passes over them (flat, or its checkpoint's
    ``loop_config``), as transformers reads them (its defaults: layers 6 to 18, three passes)."""
    nested = config.get("loop_config")
    nested = nested if isinstance(nested, Mapping) else {}
    return (int(nested.get("core_start", config.get("loop_layer_index_start", 6))),
            int(nested.get("core_end", config.get("loop_layer_index_end", 18))),
            int(nested.get("num_passes", config.get("loop_num_passes", 3))))


def _looping(config: Mapping[str, Any]) -> str | None:
    start, end, passes = _loop(config)
    layers = config.get("num_hidden_layers")
    if passes > 1 and end > start and (type(layers) is not int or start < layers):
        return f"loops its layers {start} to {end - 1} ({passes} passes: loop_num_passes)"
    return None


# families that loop some of their layers as their config says (none where it loops none)
LOOPS_AS_CONFIGURED: Mapping[str, Callable[[Mapping[str, Any]], str | None]] = MappingProxyType({
    "inkling2_loop_text": _looping,
})


def not_a_stack(model_type: object, config: Mapping[str, Any] | None = None) -> str | None:
    """What a family of ``model_type`` (its layers' ``config`` where known) does with its layers instead of running
    them one after another (None: it runs them so)."""
    looping = LOOPS_AS_CONFIGURED.get(str(model_type))
    return NOT_A_STACK.get(str(model_type)) or (looping(config) if looping and config is not None else None)


def not_causal(model_type: object, config: Mapping[str, Any]) -> str | None:
    """Why a model of ``model_type`` whose config is ``config`` is no causal LM (None: it is, or not known)."""
    judged = NOT_CAUSAL_AS_CONFIGURED.get(str(model_type))
    return judged(config) if judged is not None else None


def not_layer_by_layer(model_type: object, config: Mapping[str, Any] | None = None) -> str | None:
    """Why a layer-by-layer pass cannot follow the forward of a family of ``model_type`` (its ``config`` where
    known; None: not known)."""
    return not_a_stack(model_type) or (not_causal(model_type, config) if config is not None else None)
