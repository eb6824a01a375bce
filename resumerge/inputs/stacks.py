"""The families whose decoder layers are no plain stack, and what each does with them instead (by config.json's model
type): a stack of slices of one is refused naming it (:mod:`resumerge.merge.plan.outconfig`), and so is a
layer-by-layer pass that cannot follow its forward (:mod:`resumerge.forward.stream`)."""

from __future__ import annotations

from collections.abc import Mapping

NOT_A_STACK: Mapping[str, str] = {
    "dory": "loops its middle layers (n_recurrent_layers, n_recurrent_loops times)",
    "hrm_text": "runs its two layer stacks in turn, in cycles",
    "zamba": "shares one transformer block across its hybrid layers",
    "zamba2": "shares its transformer blocks across its hybrid layers",
}


def not_a_stack(model_type: object) -> str | None:
    """What a family of ``model_type`` does with its layers instead of running them one after another (None: it
    runs them so)."""
    return NOT_A_STACK.get(str(model_type))
