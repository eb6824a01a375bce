"""The families whose decoder layers are no plain stack, and what each does with them instead (by config.json's model
type): a stack of slices of one is refused naming it (:mod:`resumerge.merge.plan.outconfig`), and so is a
layer-by-layer pass that cannot follow its forward (:mod:`resumerge.forward.stream`), as it is for the families whose
layers do stack but hand each other more than their hidden states (:data:`NOT_ONE_STREAM`)."""

from __future__ import annotations

from collections.abc import Mapping

NOT_A_STACK: Mapping[str, str] = {
    "dory": "loops its middle layers (n_recurrent_layers, n_recurrent_loops times)",
    "hrm_text": "runs its two layer stacks in turn, in cycles",
    "zamba": "shares one transformer block across its hybrid layers",
    "zamba2": "shares its transformer blocks across its hybrid layers",
}

# families whose layers run one after another (a slice of them is one) but hand the next layer a second stream beside
# the hidden states, which a layer-by-layer pass does not follow
NOT_ONE_STREAM: Mapping[str, str] = {
    "reformer": "runs its layers as a reversible pair of streams (each takes the previous layer's attention output "
                "beside its hidden states)",
}


def not_a_stack(model_type: object) -> str | None:
    """What a family of ``model_type`` does with its layers instead of running them one after another (None: it
    runs them so)."""
    return NOT_A_STACK.get(str(model_type))


def not_layer_by_layer(model_type: object) -> str | None:
    """Why a layer-by-layer pass cannot follow the forward of a family of ``model_type`` (None: not known)."""
    return not_a_stack(model_type) or NOT_ONE_STREAM.get(str(model_type))
