"""Non-float tensors (integer buffers, bool masks, int64 position ids): never blended.

A non-float tensor of several inputs is copied from the base (the first input without one) when it is equal in
every input, and refused with its name when it is not: at plan time when the headers already tell (another dtype;
shapes are refused for every tensor) or its inputs' stored bytes are on disk and differ (a local model's: DeepSeek-V4's
hash-routing tables ``tid2eid``, read at planning, :func:`refuse_differing`), else when it is read (a hub model's
files, not fetched at planning), with the same line (:func:`differs`). Quantized codes
are not this case: a codec claims them and decodes them to floats, so their value dtype is a float one.

The copy is this module's unit (:data:`UNITS`, handed to the engine through the plan's units), so a tensor's
inputs are compared chunk by chunk as they are read, and the result is the base's stored dtype, never cast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from resumerge.errors import ModelInputError
from resumerge.inputs.safetensors_format import DTYPE_SIZES, numel
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.registry import MergeContext, MethodSpec, declared
from resumerge.merge.plan.accounting import Drops
from resumerge.merge.plan.merge_plan import InputRef, TensorPlan

NONFLOAT_COPY = "nonfloat_copy"
# Why a non-float tensor's other inputs are not in the output (resumerge.merge.plan.accounting).
CHECKED_EQUAL = "non-float, compared with the base's, whose copy is kept"
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"})


def is_float(dtype: str) -> bool:
    """Whether safetensors dtype ``dtype`` holds floating-point values."""
    return dtype in FLOAT_DTYPES


def differs(name: str, models: Sequence[str], base: int, other: int, what: str = "values") -> ModelInputError:
    """The refusal of non-float tensor ``name`` whose input ``other`` differs from input ``base`` (``models`` are
    the inputs' model keys) in ``what``."""
    return ModelInputError(
        f"non-float tensor {name} differs between {models[base]} and {models[other]} ({what}): non-float tensors "
        "are copied, never blended",
        tensor=name,
        hint="take it from one model (put it in a slice of its own, or merge models whose copies are equal)",
    )


def nonfloat_tensor(name: str, inputs: Sequence[InputRef], base_index: int | None, drops: Drops) -> TensorPlan:
    """The plan of output tensor ``name`` made of non-float ``inputs`` (of one shape): the base's copy (the first
    input's without a base) in its stored dtype, its other inputs compared when read and told to ``drops``. Raises
    the refusal of :func:`differs` when an input's dtype differs from the base's."""
    base = base_index if base_index is not None else 0
    keys = tuple(ref.model for ref in inputs)
    dtype = inputs[base].value_dtype
    for i, ref in enumerate(inputs):
        if ref.value_dtype != dtype:
            raise differs(name, keys, base, i, f"{dtype} and {ref.value_dtype}")
        if i != base:
            drops.add(ref.model, (ref.tensor,), CHECKED_EQUAL)
    shape = inputs[base].value_shape
    return TensorPlan(name=name, shard="", method=NONFLOAT_COPY, inputs=tuple(inputs), base_index=base_index,
                      model_params=tuple(() for _ in inputs), params=(("models", keys), ("tensor", name)),
                      shape=shape, compute_dtype=None, out_dtype=dtype, nbytes=numel(shape) * DTYPE_SIZES[dtype])


def refuse_differing(tensors: Mapping[str, TensorPlan], directories: Mapping[str, Path]) -> None:
    """Raise the refusal of :func:`differs` for the first (by name) non-float tensor of several inputs whose stored
    bytes differ from the base's (the first input's without a base), of the inputs whose safetensors files are on
    disk under their model's folder in ``directories`` (by model key); the others are compared when read."""
    for name in sorted(tensors):
        tp = tensors[name]
        if tp.method != NONFLOAT_COPY or len(tp.inputs) < 2:
            continue
        base = tp.base_index if tp.base_index is not None else 0
        keep = _stored_bytes(tp.inputs[base], directories)
        for i, ref in enumerate(tp.inputs):
            found = _stored_bytes(ref, directories) if keep is not None and i != base else None
            if found is not None and found != keep:
                raise differs(name, tuple(r.model for r in tp.inputs), base, i)


def _stored_bytes(ref: InputRef, directories: Mapping[str, Path]) -> bytes | None:
    """The bytes input ``ref`` is stored as, where they are a plain safetensors tensor in a file on disk."""
    folder = directories.get(ref.model)
    if folder is None or not ref.codec.plain or ref.cast or ref.lora or not ref.file.endswith(".safetensors"):
        return None
    path = folder / ref.file
    if not path.is_file():
        return None
    with path.open("rb") as f:
        f.seek(ref.start)
        return f.read(ref.end - ref.start)


def nonfloat_copy(ctx: MergeContext) -> torch.Tensor:
    """The base's tensor (the first input's without a base), once every input is equal to it; else the refusal of
    :func:`differs` (the tensor's name and the inputs' model keys are in ``params``)."""
    base = ctx.base_index if ctx.base_index is not None else 0
    keep = ctx.tensors[base]
    for i, tensor in enumerate(ctx.tensors):
        if i != base and not torch.equal(tensor, keep):
            raise differs(ctx.params["tensor"], ctx.params["models"], base, i)
    return keep.clone()


# The unit of this module (its footprint: a clone of one input, nothing but the result; an integer dtype is not
# measured, so the rule of thumb covers it), which a merge plan with non-float tensors hands the engine (Plan.units).
UNITS = declared(
    MethodSpec(name=NONFLOAT_COPY, fn=nonfloat_copy, min_inputs=1, elementwise=True,
               reference="issue 44: non-float tensors are never blended",
               footprint=measured((0, 0), (0, 0), (0, 0), (0, 0), in_output=True)),
)
