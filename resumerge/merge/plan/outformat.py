"""How an output tensor is stored: the format its inputs are stored in (a format read and written alike is kept,
with the companions it carries; one read only is stored plainly), marked as a copy of its sole input where its value
is exactly that input's, and the dtype it is computed for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType

from resumerge.config.merge_config import MergeConfig
from resumerge.inputs.codecs import PLAIN, TensorEncoder
from resumerge.merge.plan.copies import stored_copy
from resumerge.merge.plan.merge_plan import InputRef, TensorPlan
from resumerge.merge.plan.tensorkinds import carried_companions

DTYPE_CODES = MappingProxyType({
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
})


def out_format(tp: TensorPlan, *, dequantize: bool) -> TensorPlan:
    """``tp`` stored in the format its base input is stored in (its first input's without a base), with the
    companions that format carries copied from that input (see :attr:`TensorPlan.carried`), sized by its stored
    parts (and copied from an input in that format when its value is exactly that input's); plainly in its
    ``out_dtype`` with ``dequantize``."""
    codec = stored_codec(tp.inputs, tp.base_index, dequantize=dequantize)
    if codec is tp.out_codec or codec == tp.out_codec:  # as the planner made it: asked of 46k tensors
        return tp
    carried = carried_companions(tp.inputs, codec, base_index=tp.base_index)
    return copied(replace(tp, out_codec=codec, carried=carried).sized())


def stored_codec(inputs: Sequence[InputRef], base_index: int | None, *, dequantize: bool) -> TensorEncoder:
    """The format an output tensor of ``inputs`` is stored in (see :func:`out_format`)."""
    codec = inputs[base_index if base_index is not None else 0].codec
    # A format read and written alike keeps it (a decoder that is an encoder too); one read only is stored plainly.
    return codec if isinstance(codec, TensorEncoder) and not dequantize else PLAIN


def copied(tp: TensorPlan) -> TensorPlan:
    """``tp`` (in its stored format, sized) marked as a copy of its sole input's stored parts when it is one
    (:func:`~resumerge.merge.plan.copies.stored_copy`)."""
    tp = stored_copy(tp)
    if tp.copy_of is not None:  # the module is that input's, whole: its carried companions too (same shapes)
        tp = replace(tp, carried=carried_companions(tp.inputs, tp.out_codec, copy_of=tp.copy_of))
    return tp


def out_dtype(config: MergeConfig, inputs: Sequence[InputRef], base_index: int | None) -> str:
    """The dtype code an output tensor of ``inputs`` is computed for: the config's ``out_dtype``, else its
    ``dtype``, else the value dtype of the base input (the first without a base)."""
    if config.out_dtype is not None:
        return DTYPE_CODES[config.out_dtype]
    if config.dtype is not None:
        return DTYPE_CODES[config.dtype]
    return inputs[base_index if base_index is not None else 0].value_dtype
