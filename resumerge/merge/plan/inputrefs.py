"""The :class:`~resumerge.merge.plan.merge_plan.InputRef` of a model's stored tensor, and its value read through its
codec: the one way every planner (merges, MoE upcycling, LoRA extraction) names an input and every reader (the
engine, the MoE and extraction preparation) reads one, so a quantized input is decoded wherever it is read."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

from resumerge.inputs.catalog import adapter_key
from resumerge.inputs.codecs import MAIN, PLAIN, Claim, StoredFormats, TensorDecoder
from resumerge.inputs.files import TensorSource
from resumerge.inputs.kernels import serial_kernels
from resumerge.inputs.model import ModelInput
from resumerge.inputs.source import InputSources
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.machine.torch_import import torch
from resumerge.merge.plan.merge_plan import InputRef, LoraRef


def stored_ref(key: str, found: TensorSource) -> InputRef:
    """The stored tensor ``found`` of input ``key``, read plainly."""
    e = found.entry
    return _stored_input(key, found.file, e.name, e.dtype, e.shape, e.start, e.end)


def adapted_ref(key: str, model: ModelInput, name: str) -> InputRef:
    """Where input tensor ``name`` of ``model`` comes from — its stored parts and their codec, when a format
    claims it — with its LoRA adapter's replacement or delta."""
    ref = tensor_ref(key, model, name)
    adapter = model.adapter
    if adapter is None:
        return ref
    where = adapter_key(key)
    replaced = adapter.replacements.get(name)
    if replaced is not None:
        value = ref.value_dtype  # the base's, as decoded
        ref = replace(stored_ref(where, replaced), cast=value if replaced.entry.dtype != value else None)
    target = adapter.targets.get(name)
    if target is not None:
        lora = LoraRef(stored_ref(where, target.a), stored_ref(where, target.b), target.scale, target.fan_in_fan_out,
                       target.embedding)
        ref = replace(ref, lora=lora)
    return ref


def tensor_ref(key: str, model: ModelInput, name: str) -> InputRef:
    """Logical tensor ``name`` of ``model`` (input ``key``; recognised: see
    :meth:`~resumerge.inputs.model.ModelInput.recognised`) — its stored main part, and its codec and companions
    when a format claims it. ``name`` must be among ``model.tensors``."""
    return refs_of(key, model)(name)


def refs_of(key: str, model: ModelInput) -> Callable[[str], InputRef]:
    """:func:`tensor_ref` of ``model`` (input ``key``) by name, with the model's tables looked up once: the planner
    asks it for every input of every output tensor (92k of them for DeepSeek-V3)."""
    formats, tensors = model.formats, model.tensors
    if formats is None or not formats.claims:
        return lambda name: stored_ref(key, tensors[name])
    claims = formats.claims

    def ref(name: str) -> InputRef:
        claim = claims.get(name)
        return stored_ref(key, tensors[name]) if claim is None else _claimed_ref(key, formats, claim)

    return ref


def format_ref(key: str, formats: StoredFormats, name: str) -> InputRef:
    """Logical tensor ``name`` of the model (input ``key``) whose stored tensors ``formats`` sorted: its main part
    with its codec and companions when a format claims it, else the stored tensor of that name."""
    claim = formats.claims.get(name)
    if claim is None:
        return stored_ref(key, formats.stored[name])
    return _claimed_ref(key, formats, claim)


def _claimed_ref(key: str, formats: StoredFormats, claim: Claim) -> InputRef:
    """The logical tensor ``claim`` names, its companions where :meth:`StoredFormats.companions` finds them."""
    stored = formats.stored
    main = stored[claim.main]
    companions = []
    for part, name in claim.parts:  # Claim.companions, without its generator: a 92k-tensor plan asks 90k times
        if part == MAIN:
            continue
        companions.append((part, stored_ref(key, stored[name])))
    e = main.entry  # built at once, not by replace(): a 92k-tensor plan makes 90k of them
    return _stored_input(key, main.file, e.name, e.dtype, e.shape, e.start, e.end, claim.codec, tuple(companions))


def _stored_input(model: str, file: str, tensor: str, dtype: str, shape: tuple[int, ...], start: int, end: int,
                  codec: TensorDecoder = PLAIN, companions: tuple[tuple[str, InputRef], ...] = ()) -> InputRef:
    """``InputRef(model, file, tensor, dtype, shape, start, end, codec=codec, companions=companions)``: a stored
    tensor read whole, uncast, with no LoRA delta; the same object, made in a quarter of the time (a DeepSeek-V3
    plan makes 184k). The frozen ``__init__`` sets all twelve fields through ``object.__setattr__``; this sets only
    those not at their defaults, which are read from the class, where the dataclass keeps them. Each is set as
    ``__init__`` sets it (not by assigning a ``__dict__``), so the instance keeps its compact attribute storage."""
    ref = _new(InputRef)
    _set(ref, "model", model)
    _set(ref, "file", file)
    _set(ref, "tensor", tensor)
    _set(ref, "dtype", dtype)
    _set(ref, "shape", shape)
    _set(ref, "start", start)
    _set(ref, "end", end)
    if codec is not PLAIN:
        _set(ref, "codec", codec)
    if companions:
        _set(ref, "companions", companions)
    return ref


_new = object.__new__
_set = object.__setattr__


def read_value(ref: InputRef, sources: InputSources, out: torch.Tensor | None = None,
               raw: torch.Tensor | None = None) -> torch.Tensor:
    """The value of ``ref`` as a method sees it, before any LoRA delta: its parts read (the rows it names) and
    decoded by its codec (a plain one returns the buffer read; a decoding one fills ``out`` when given, a
    contiguous buffer of the decoded value's shape and dtype; its stored bytes read into ``raw`` when given, a
    uint8 buffer of at least their size), cast to ``ref.cast``. A quantized format's decode
    runs on the calling thread alone (:func:`~resumerge.inputs.kernels.serial_kernels`: many small kernels, 10x
    slower split over threads that other work keeps busy), whoever reads it (the engine, the MoE pass, LoRA
    extraction's ranks)."""

    def read(r: InputRef, into: torch.Tensor | None = None) -> torch.Tensor:
        if into is None:
            return sources.read(r.model, r.file, r.start, r.end, r.dtype, r.shape)
        return sources.read(r.model, r.file, r.start, r.end, r.dtype, r.shape, into)

    with nullcontext() if ref.codec.plain else serial_kernels():
        t = ref.codec.decode({MAIN: read(ref, raw), **{part: read(c) for part, c in ref.companions}}, ref.first_row,
                             out)
    return t.to(TORCH_DTYPES[ref.cast]) if ref.cast is not None else t
