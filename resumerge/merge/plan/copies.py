"""Output tensors that are exactly one input's value, copied in their stored format instead of decoded and
re-encoded: a passthrough without ``scale``, a linear merge whose weights are one-hot (``weight: [1, 0]``, or the
per-tensor weights of a ``filter:`` recipe that takes a tensor class whole from one parent).

Re-encoding a quantized tensor from its own decoded value need not give its stored codes and scales back (a block's
scale is recomputed from its rounded values); a copy does, byte for byte. Only a tensor whose output codec is the
input's own, not plain, is marked: a plain tensor's computed bytes are its stored ones already, and its plan (and
fingerprint) stays what it was.
"""

from __future__ import annotations

from dataclasses import replace

from resumerge.inputs.codecs import MAIN, TensorEncoder
from resumerge.merge.plan.merge_plan import TensorPlan


def sole_input(tp: TensorPlan) -> int | None:
    """The index of the input whose value ``tp``'s method returns unchanged, or None."""
    if tp.vocab_aligned:
        return None
    params = [dict(p) for p in tp.model_params]
    if tp.method == "passthrough":
        return 0 if params and params[0].get("scale") is None else None
    if tp.method == "linear":
        weights = [float(p.get("weight") or 0.0) for p in params]
        hot = [i for i, w in enumerate(weights) if w != 0.0]
        if len(hot) == 1 and (dict(tp.params).get("normalize", True) or weights[hot[0]] == 1.0):
            return hot[0]
    return None


def stored_copy(tp: TensorPlan) -> TensorPlan:
    """``tp`` marked to be copied from its sole input's stored parts (:attr:`TensorPlan.copy_of`) when that input
    is stored in ``tp``'s own non-plain output format, part for part (same dtypes and shapes), with no cast or LoRA
    delta; else ``tp`` unchanged."""
    if tp.out_codec.plain or tp.blocks is not None:  # asked first: it is cheaper (a table cut per layer is no copy)
        return tp
    index = sole_input(tp)
    if index is None:
        return tp
    ref = tp.inputs[index]
    if not isinstance(ref.codec, TensorEncoder) or ref.codec != tp.out_codec or ref.cast is not None \
            or ref.lora is not None:
        return tp
    stored = {MAIN: (ref.dtype, ref.shape), **{part: (c.dtype, c.shape) for part, c in ref.companions}}
    planned = {p.part: (p.dtype, p.shape) for p in tp.stored_parts()}
    return replace(tp, copy_of=index) if stored == planned else tp
