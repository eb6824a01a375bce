"""The frozen merge plan: every output tensor, its inputs, method, parameters, dtype and shard, decided up front.

A :class:`Plan` is pure data (but for :attr:`Plan.units`, the code of its kind's own units). The engine only
executes it; its :attr:`Plan.fingerprint` (plan contents, resumerge version, input file identities) is stored with
the run, and a resume whose freshly built plan has another fingerprint is refused saying what differs
(:func:`resumerge.merge.plan.changes.describe_changes`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from resumerge.config.version import __version__
from resumerge.errors import ResumergeError
from resumerge.inputs.codecs import PLAIN, OutPart, TensorDecoder, TensorEncoder
from resumerge.inputs.safetensors_format import DTYPE_SIZES, ShardLayout, layout_shard, numel
from resumerge.machine.memory.sizes import format_size
from resumerge.merge.methods.registry import MethodSpec, get_method
from resumerge.merge.plan.defaults import DEFAULT_SEED as DEFAULT_SEED
from resumerge.merge.plan.defaults import DEFAULT_SHARD_SIZE as DEFAULT_SHARD_SIZE
from resumerge.merge.plan.layerblocks import LayerBlocks
from resumerge.merge.plan.options import LATER_OPTIONS as LATER_OPTIONS
from resumerge.merge.plan.options import PATH_OPTIONS as PATH_OPTIONS
from resumerge.merge.plan.options import PlanOptions as PlanOptions
from resumerge.merge.plan.planjson import dumps as _dumps
from resumerge.merge.plan.planjson import sha as _sha
from resumerge.outputs.containers import SAFETENSORS, OutputContainer

if TYPE_CHECKING:
    from resumerge.config.merge_config import MergeConfig
    from resumerge.merge.plan.accounting import Accounting
    from resumerge.merge.plan.cardwording import CardWording
    from resumerge.merge.plan.filters import FilterMatch
    from resumerge.merge.vocab import VocabAlignment


@dataclass(frozen=True)
class LoraRef:
    """A LoRA delta on an input tensor: factors A and B (read whole; small), ``scale`` and PEFT's merge flags."""

    a: InputRef
    b: InputRef
    scale: float
    fan_in_fan_out: bool
    embedding: bool


@dataclass(frozen=True)
class InputRef:
    """One input tensor of an output tensor: model key, weight file, tensor name, dtype, shape, byte range.
    ``cast`` is the dtype the stored tensor is converted to when read (a LoRA adapter's replacement of a base
    tensor takes the base's dtype, as PEFT loads it); ``lora`` a delta added after that; ``first_row`` the
    tensor's first row within the whole tensor when this reference is a row chunk (the LoRA factors are whole).
    ``codec`` decodes the stored tensor (its main part) and its ``companions`` (by the codec's part names, each
    in any file of the model) into the value, before the cast; dtype, shape and range are the main part's."""

    model: str
    file: str
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    cast: str | None = None
    lora: LoraRef | None = None
    first_row: int = 0
    codec: TensorDecoder = PLAIN
    companions: tuple[tuple[str, InputRef], ...] = ()

    @property
    def value_dtype(self) -> str:
        """The dtype of the tensor as the method sees it (decoded, then ``cast``)."""
        return self.cast or self.codec.value_dtype(self.dtype)

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The shape of the decoded tensor (a packed format's main part has another)."""
        return self.codec.value_shape(self.shape)

    @property
    def stored_bytes(self) -> int:
        """Bytes read for this reference: the main part and its companions."""
        size = self.end - self.start
        for _, c in self.companions:  # a loop, not sum(): asked three times for each input of a 92k-tensor plan
            size += c.end - c.start
        return size

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the decoded value a non-plain codec makes (0 for a plain one, whose value is its buffer)."""
        return 0 if self.codec.plain else numel(self.value_shape) * DTYPE_SIZES[self.codec.value_dtype(self.dtype)]

    def rows(self, first: int, stop: int) -> InputRef:
        """This reference limited to its rows ``[first, stop)``: a byte range of the main part (row-major storage
        keeps rows contiguous; its rows are the value's) and of each companion, the rows the codec says those
        value rows need (:meth:`~resumerge.inputs.codecs.TensorDecoder.part_rows`; a part without rows whole)."""
        row_bytes = (self.end - self.start) // self.shape[0]
        whole = (self.first_row + first, self.first_row + stop)
        companions = tuple(
            (part, c if not c.shape else c.rows(*(r - c.first_row for r in self.codec.part_rows(part, *whole))))
            for part, c in self.companions)
        return replace(self, shape=(stop - first, *self.shape[1:]), start=self.start + first * row_bytes,
                       end=self.start + stop * row_bytes, first_row=whole[0], companions=companions)


@dataclass(frozen=True)
class ExpertStack:
    """A fused expert tensor: ``count`` experts stacked along dim 0, each holding ``parts`` projections (gate and
    up: 2) along ``axis`` of one expert's slice — one after the other, or alternating when ``interleaved``
    (gpt-oss). A method that is not elementwise merges each projection of each expert on its own."""

    count: int
    parts: int = 1
    axis: int = 0
    interleaved: bool = False


@dataclass(frozen=True)
class TensorPlan:
    """How one output tensor is made and where it goes."""

    name: str
    shard: str
    method: str
    inputs: tuple[InputRef, ...]
    base_index: int | None
    model_params: tuple[tuple[tuple[str, Any], ...], ...]
    params: tuple[tuple[str, Any], ...]
    shape: tuple[int, ...]
    compute_dtype: str | None
    out_dtype: str
    nbytes: int
    # A vocabulary-axis tensor (embeddings, lm_head) whose inputs are re-indexed to the built output vocabulary
    # (Plan.vocab) before the method runs; its inputs may then have different row counts.
    vocab_aligned: bool = False
    # How the result is stored: the parts the shard holds for it (see stored_parts), encoded from the result.
    out_codec: TensorEncoder = PLAIN
    # The input whose stored parts are this tensor's, copied byte for byte (its value is exactly that input's and
    # both are stored in the same non-plain format: see resumerge.merge.plan.copies); None: computed and encoded.
    copy_of: int | None = None
    # A fused stack of experts its method merges one expert's projection at a time (see resumerge.merge.plan.experts);
    # None: merged whole.
    experts: ExpertStack | None = None
    # A table packed per layer cut for a new stack of layers, merged block by block (resumerge.merge.plan.layerblocks).
    blocks: LayerBlocks | None = None
    # Companions stored beside the result but not computed from it (a static activation's input_scale), by part
    # name: each written as the stored bytes of that input companion (the one of the input whose format the output
    # keeps), under the output tensor's module (see resumerge.merge.plan.outformat.out_format); recorded only when any.
    carried: tuple[tuple[str, InputRef], ...] = ()

    def reads(self) -> tuple[InputRef, ...]:
        """Every input reference this tensor reads: each input, its companions and a LoRA delta's two factors
        right after the one they belong to."""
        if not any(ref.companions or ref.lora is not None for ref in self.inputs):
            return self.inputs  # plain inputs (asked four times of each tensor of a 90k-tensor run): as they are
        return tuple(r for ref in self.inputs
                     for r in (ref, *(c for _, c in ref.companions), *((ref.lora.a, ref.lora.b) if ref.lora else ())))

    def stored_parts(self) -> tuple[OutPart, ...]:
        """The stored tensors this output tensor is written as (itself alone, for a plain output): its codec's
        parts, then the companions it carries."""
        return stored_parts_of(self.name, self.out_dtype, self.shape, self.out_codec, self.carried)

    def sized(self) -> TensorPlan:
        """This plan with ``nbytes`` the bytes of its stored parts (all of them: the shard holds them all)."""
        return replace(self, nbytes=parts_bytes(self.stored_parts()))

    def in_shard(self, shard: str) -> TensorPlan:
        """This plan with ``shard`` set: a copy of its fields, as ``replace`` makes it but without passing each
        through ``__init__`` again (a third of the time of placing 92k tensors in shards)."""
        placed = object.__new__(type(self))
        placed.__dict__.update(self.__dict__, shard=shard)
        return placed


def stored_parts_of(name: str, dtype: str, shape: tuple[int, ...], codec: TensorEncoder,
                    carried: tuple[tuple[str, InputRef], ...]) -> tuple[OutPart, ...]:
    """:meth:`TensorPlan.stored_parts` of an output tensor ``name`` of value ``dtype`` and ``shape`` stored in
    ``codec`` with the ``carried`` companions, before its plan is made (a planner sizes it at once)."""
    module = name.removesuffix("weight")
    return (*codec.out_parts(name, dtype, shape),
            *(OutPart(part, f"{module}{part}", ref.dtype, ref.shape) for part, ref in carried))


def parts_bytes(parts: Iterable[OutPart]) -> int:
    """The bytes stored ``parts`` take in a shard."""
    return sum(numel(p.shape) * DTYPE_SIZES[p.dtype] for p in parts)


@dataclass(frozen=True)
class ShardPlan:
    """One output shard: final file name, tensors in on-disk data order, exact file size; ``units``: for a file
    written in place unit by unit (a GGUF output, whose layout the plan fixes), how many of ``tensors`` each unit
    after the header holds, in order (:meth:`Plan.file_units`); empty: the file is one unit (a safetensors shard)."""

    name: str
    tensors: tuple[str, ...]
    file_size: int
    units: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Everything the engine needs; nothing here depends on the machine, the time, or the output path."""

    method: str
    tensors: Mapping[str, TensorPlan]
    shards: tuple[ShardPlan, ...]
    donor: str
    tokenizer_donor: str | None
    num_layers: int
    layer_origins: tuple[tuple[str, int], ...]
    inputs: Mapping[str, tuple[tuple[str, int, str], ...]]
    model_dirs: Mapping[str, str] = field(compare=False)
    options: PlanOptions = PlanOptions()
    out_config: Mapping[str, Any] = field(default_factory=dict)
    tokenizer_files: tuple[tuple[str, str], ...] = ()
    # Tokenizer files whose bytes the plan made (a built tokenizer, or a donor's with chat_template applied);
    # files not here are copied from the tokenizer donor. Hashes are in tokenizer_files.
    tokenizer_blobs: Mapping[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    # How each input's vocabulary rows map to the built tokenizer's (None when no tokenizer is built).
    vocab: VocabAlignment | None = field(default=None, compare=False, repr=False)
    vocab_digest: str = ""
    extra_parts: tuple[tuple[str, str], ...] = ()  # fingerprint parts of the plan's kind (a transplant's: its planner)
    fingerprint: str = ""
    # The parts ``fingerprint`` hashes (:func:`fingerprint_parts`), kept by :func:`fingerprinted` so that recording
    # the run does not render 90k tensors' plans again; used only while ``fingerprint`` is their hash.
    parts: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    # Facts the user must hear about (vocabulary rows cut by --unsafe-truncate-embeddings, …): logged when the
    # run starts, shown by status, written in the model card. Derived from the rest of the plan.
    notes: tuple[str, ...] = field(default=(), compare=False)
    # What the output's files are (safetensors shards, a GGUF file or split set, a PEFT adapter), chosen once by
    # the planner: their layout, side files, fingerprint extras (an adapter's side files and a GGUF's headers, by
    # their hashes), the estimate's fact, the card's tags and verify's rule (resumerge.outputs.containers).
    container: OutputContainer = field(default=SAFETENSORS, compare=False, repr=False)
    # How many stored tensors of each input model have each role (weight, companion, other: see
    # resumerge.inputs.codecs.Role), by model key, for plan, status and verify to report. Derived from the inputs.
    input_roles: Mapping[str, Mapping[str, int]] = field(default_factory=dict, compare=False)
    # The unit functions of the kind of run that made the plan, beyond the built-in merge methods (MoE upcycling's
    # routers and experts, LoRA extraction's factors), declared in that kind's package: :meth:`method_of` finds a
    # tensor's method here. Code, not data: never fingerprinted nor written; planning again gives them again.
    units: tuple[MethodSpec, ...] = field(default=(), compare=False, repr=False)
    # What the model card lists when the run's recorded text is not a merge config (a mergekit-moe config): the
    # merge config of its models and name, as mergekit-moe lists them, and its method line (display name,
    # description, link), so the card never asks which kind made the plan; None: the card reads the recorded merge
    # config and the method's declaration. Derived from the recorded text: not fingerprinted.
    card_config: MergeConfig | None = field(default=None, compare=False, repr=False)
    card_method: tuple[str, str, str] | None = field(default=None, compare=False, repr=False)
    # The card's words where the run is not a merge (a transplant's); None: a merge's. In its kind's extra_parts.
    card_wording: CardWording | None = field(default=None, compare=False, repr=False)
    # The name of the output's copy of the recorded text (with the model card; mergekit_config.yml as mergekit-yaml
    # writes it, or what the kind of run that made the plan names it: mergekit-moe's mergekit_moe_config.yml), so
    # the output's files never ask which kind made the plan. A file name, like the shards': not fingerprinted.
    config_copy: str = field(default="mergekit_config.yml", compare=False)
    # Each ``filter:`` the planner consulted, with how many output tensors it matched, and what became of every
    # input tensor (merged, copied, renumbered, dropped and why; None for a plan that does not say: an extraction's).
    # Derived from the config and the inputs: not fingerprinted.
    filters: tuple[FilterMatch, ...] = field(default=(), compare=False, repr=False)
    accounting: Accounting | None = field(default=None, compare=False, repr=False)

    def headline(self) -> str:
        """``linear: 39 tensors, 4 layers, 1 shard(s); config from A, tokenizer from A``: ``plan``'s first line."""
        tokenizer = (f"tokenizer from {self.tokenizer_donor}" if self.tokenizer_donor is not None
                     else "tokenizer built from the inputs' tokenizers" if self.tokenizer_files
                     else self.container.tokenizer_note() or "no tokenizer (--no-copy-tokenizer)")
        return (f"{self.method}: {len(self.tensors)} tensors, {self.num_layers} layers, {len(self.shards)} "
                f"shard(s); config from {self.donor}, {tokenizer}")

    def __repr__(self) -> str:
        """The plan's short text, not every tensor's plan (255 KB in a notebook cell ending in ``plan_merge``)."""
        facts = [("output", f"{format_size(self.total_bytes)} in {len(self.shards)} shard(s)"),
                 *([("inputs", self.accounting.summary())] if self.accounting is not None else []),
                 *(("note", note) for note in self.notes), ("fingerprint", self.fingerprint)]
        return "\n".join([self.headline(), *(f"{label:<13}{text}" for label, text in facts)])

    @property
    def total_bytes(self) -> int:
        """Bytes of all output shards together."""
        return sum(s.file_size for s in self.shards)

    def shard_layout(self, shard: ShardPlan) -> ShardLayout:
        """The byte layout of ``shard`` (header and data order), as the writer must produce it."""
        parts = [(p.name, p.dtype, p.shape) for n in shard.tensors for p in self.tensors[n].stored_parts()]
        return self.container.layout(shard.name, parts, shard.file_size)

    def file_units(self, shard: ShardPlan) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
        """The units ``shard`` is written and journaled in, as (first byte, end byte, output tensors): the header
        (no tensor), then each group of :attr:`ShardPlan.units` with the padding after its tensors, so that the
        units tile the file; empty for a shard written whole."""
        if not shard.units:
            return ()
        layout = self.shard_layout(shard)
        data = len(layout.header)
        where = {p.name: p.offset for p in layout.order}
        starts, groups, at = [], [], 0
        for count in shard.units:
            names = shard.tensors[at:at + count]
            at += count
            starts.append(data + min(where[p.name] for p in self.tensors[names[0]].stored_parts() if p.name in where))
            groups.append(names)
        ends = [*starts[1:], shard.file_size]
        return ((0, data, ()), *((s, e, g) for s, e, g in zip(starts, ends, groups, strict=True)))

    def method_of(self, tp: TensorPlan) -> MethodSpec:
        """The method that computes ``tp``: a built-in merge method or one of :attr:`units`."""
        spec = get_method(tp.method, self.units)
        if spec is None:
            raise ResumergeError(f"internal: unknown method {tp.method}", tensor=tp.name)
        return spec

    def shard_parts(self, shard: ShardPlan) -> dict[str, tuple[str, ...]]:
        """The stored parts of each output tensor of ``shard`` (its layout's names), in the shard's order."""
        return {n: tuple(p.name for p in self.container.parts_in(shard.name, self.tensors[n].stored_parts()))
                for n in shard.tensors}  # all of them, but in files written together (a GGUF release's)

    @property
    def weight_map(self) -> dict[str, str]:
        """Output tensor name -> shard file name, sorted by tensor name."""
        return {name: self.tensors[name].shard for name in sorted(self.tensors)}


def stored_layout(tensors: Mapping[str, TensorPlan], names: Iterable[str]) -> ShardLayout:
    """The byte layout of a shard holding output tensors ``names`` of ``tensors``: every stored part of each
    (:meth:`TensorPlan.stored_parts`) where safetensors puts it."""
    return layout_shard({p.name: (p.dtype, p.shape) for n in names for p in tensors[n].stored_parts()})


def fingerprint_parts(plan: Plan) -> dict[str, str]:
    """Hashes of the plan's separable parts; a mismatch in one part tells the user what changed. Those kept on the
    plan by :func:`fingerprinted` when they are still what its fingerprint hashes, else rendered from the plan."""
    if plan.parts and _sha(dict(plan.parts)) == plan.fingerprint:
        return dict(plan.parts)
    body: dict[str, Any] = {
        "method": plan.method,
        "shards": [{"name": s.name, "tensors": s.tensors, "file_size": s.file_size,
                    **({"units": s.units} if s.units else {})} for s in plan.shards],  # a GGUF's units only
        "donor": plan.donor,
        "tokenizer_donor": plan.tokenizer_donor,
        "layer_origins": plan.layer_origins,
        "out_config": plan.out_config,
        "tokenizer_files": plan.tokenizer_files,
        "vocab": plan.vocab_digest,
    }
    body.update(plan.container.fingerprint_extras())  # none for safetensors shards: a merge's is unchanged
    return {
        "plan": _body_sha(body, plan.tensors),
        "options": _sha(_output_options(plan.options)),
        "inputs": _sha({k: list(v) for k, v in sorted(plan.inputs.items())}),
        "version": __version__, **dict(plan.extra_parts)}


def fingerprinted(plan: Plan) -> Plan:
    """``plan`` with its fingerprint set (:func:`compute_fingerprint`) and the parts it hashes kept beside it. A plan
    replaced in anything its fingerprint covers must be fingerprinted again: its fingerprint and parts are stale."""
    parts = fingerprint_parts(replace(plan, parts=()))
    return replace(plan, fingerprint=_sha(parts), parts=tuple(parts.items()))


def compute_fingerprint(plan: Plan) -> str:
    """The fingerprint of ``plan`` as it is now: sha256 over its parts (plan body, options, input identities,
    version), rendered from the plan whatever parts it keeps."""
    return _sha(fingerprint_parts(replace(plan, parts=())))


_TENSORS_AT_ONCE = 1024  # tensor records hashed per update: few calls, and no 90k records' text alive at once


def _body_sha(body: Mapping[str, Any], tensors: Mapping[str, TensorPlan]) -> str:
    """:func:`_sha` of ``body`` with ``"tensors"``: the list of the records of ``tensors`` by name
    (:class:`_Records`), hashed as rendered: the same text as ``json.dumps`` of the whole, since a list's JSON is its
    items' joined by the separator and a sorted object's is its keys' in order."""
    digest = hashlib.sha256()
    records = _Records()
    names = sorted(tensors)
    for i, key in enumerate(sorted([*body, "tensors"])):
        digest.update(("{" if i == 0 else ",").encode() + _dumps(key).encode() + b":")
        if key != "tensors":
            digest.update(_dumps(body[key]).encode())
            continue
        digest.update(b"[")
        for at in range(0, len(names), _TENSORS_AT_ONCE):
            text = ",".join([records.tensor(tensors[n]) for n in names[at:at + _TENSORS_AT_ONCE]])
            digest.update((("," if at else "") + text).encode())
        digest.update(b"]")
    digest.update(b"}")
    return digest.hexdigest()


# Fingerprinted beside a recorded -j (issue 87): a serial block pins MKL's threads too (resumerge.inputs.kernels), so
# a plan whose bytes follow -j computes its MKL kernels (SVDs, QRs, solves) on other threads than a run recorded
# before did with the same -j; that run's plan must not match today's, or its resume would mix both.
PINNED_KERNELS = "serial-blocks-pin-mkl"


def _output_options(options: PlanOptions) -> dict[str, Any]:
    """The options that change output bytes, as fingerprinted: a file's digest, never its path (PATH_OPTIONS)."""
    found = {k: v for k, v in asdict(options).items() if k not in ("allow_crimes", "stream_inputs", *PATH_OPTIONS)
             and (k not in LATER_OPTIONS or v != LATER_OPTIONS[k])}
    if options.num_threads is not None:
        found["kernels"] = PINNED_KERNELS
    return found


class _Records:
    """The text the fingerprint records of each tensor: the JSON (:func:`_dumps`) of ``dataclasses.asdict`` of its
    plan, but its inputs as lists (:meth:`input`) and its later fields (out_codec, copy_of, experts, carried) only
    when set, so that plans made before they existed keep their fingerprints.

    A plan's 92k records are 51 MB of text that a json.dumps of each took seconds to write, most of it alike:
    each record is made from a form (its text with holes for what each tensor has of its own: its name, shard,
    size, shape and inputs; an input's tensor name and companions) rendered once per kind of record, as
    ``json.dumps`` would join the pieces. A form is found by the identity of the values it holds (each held here,
    so that no other object takes its id while the records are made), or by value where that is exact: strings,
    and shapes (tuples of ints read from validated headers: equal ones render alike).
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[object, str]] = {}
        self._shapes: dict[tuple[int, ...], str] = {}
        self._tensors: dict[tuple[int | bool, ...], tuple[object, str]] = {}
        self._inputs: dict[tuple[object, ...], tuple[TensorDecoder, str]] = {}  # its codec held

    def tensor(self, t: TensorPlan) -> str:
        """The record of ``t``: its fields by name (as ``sort_keys`` orders them), those left out when unset skipped."""
        shared = _SHARED(t)
        carried = t.carried
        key = (*map(id, shared), bool(carried))
        found = self._tensors.get(key)
        if found is None:
            found = self._tensors[key] = (shared, self._tensor_form(t))
        own = (self._carried(carried),) if carried else ()  # the holes in _OWN's order
        return found[1] % (*own, "[" + ",".join([self.input(i) for i in t.inputs]) + "]", _STR(t.name),
                           self.value(t.nbytes), self.shape(t.shape), _STR(t.shard))

    def input(self, i: InputRef) -> str:
        """The record of an input reference: model, file, tensor, dtype, shape, then its cast, LoRA delta and codec
        (with its companions) as tagged lists, each only when set (a plain input's record is what it was before
        codecs)."""
        if i.lora is not None:
            return self._input_form(i, i.tensor) % self._companions(i)
        key = (i.model, i.file, i.dtype, i.shape, i.cast, id(i.codec))
        found = self._inputs.get(key)
        if found is None:
            found = self._inputs[key] = (i.codec, self._input_form(i))
        return found[1] % (_STR(i.tensor), self._companions(i) if i.companions else "")

    def value(self, value: Any) -> str:
        """``value`` as json.dumps writes it."""
        kind = type(value)
        if kind is str:
            return _STR(value)
        if kind is int:
            return repr(value)
        if value is None or kind is bool:
            return _CONSTANTS[value]
        found = self._held.get(id(value))
        if found is None:
            found = self._held[id(value)] = (value, _dumps(value))
        return found[1]

    def shape(self, shape: tuple[int, ...]) -> str:
        found = self._shapes.get(shape)
        if found is None:
            found = self._shapes[shape] = _dumps(shape)
        return found

    def _tensor_form(self, t: TensorPlan) -> str:
        items = []
        for name in _FIELDS:
            if name in _OWN:
                text: str | None = "%s" if name != "carried" or t.carried else None
            elif name == "out_codec":
                text = None if t.out_codec.plain else _form(self._identity(t.out_codec))
            else:
                value = getattr(t, name)
                text = None if value is None and name in _LATER_FIELDS else _form(self.value(value))
            if text is not None:
                items.append(f'"{name}":{text}')
        return "{" + ",".join(items) + "}"

    def _input_form(self, i: InputRef, tensor: str | None = None) -> str:
        """The form of ``i``'s record: a hole for its tensor name (filled now when ``tensor`` is given) and one at
        the end of its codec's list for its companions."""
        name = "%s" if tensor is None else _form(_STR(tensor))
        items = [_STR(i.model), _STR(i.file), _STR(i.dtype), self.shape(i.shape)]
        if i.cast is not None:
            items.append('["cast",' + _STR(i.cast) + "]")
        if i.lora is not None:
            lora = i.lora
            items.append('["lora",' + ",".join([self.input(lora.a), self.input(lora.b), self.value(lora.scale),
                                                  self.value(lora.fan_in_fan_out), self.value(lora.embedding)]) + "]")
        model, file, *rest = map(_form, items)
        text = ",".join([model, file, name, *rest])
        if i.codec.plain:
            return "[" + text + "%s]"  # no companions: an empty hole
        identity = self._identity(i.codec)
        return "[" + text + ',["codec"' + ("," + _form(identity[1:-1]) if identity != "[]" else "") + "%s]]"

    def _companions(self, i: InputRef) -> str:
        """What fills the hole at the end of ``i``'s codec list: a ``[part, record]`` for each companion."""
        if not i.companions or i.codec.plain:
            return ""
        return "".join([",[" + _STR(part) + "," + self.input(c) + "]" for part, c in i.companions])

    def _carried(self, carried: tuple[tuple[str, InputRef], ...]) -> str:
        return "[" + ",".join(["[" + _STR(part) + "," + self.input(ref) + "]" for part, ref in carried]) + "]"

    def _identity(self, codec: TensorDecoder | TensorEncoder) -> str:
        """A codec's identity (:meth:`~resumerge.inputs.codecs.TensorDecoder.identity`) as a list."""
        found = self._held.get(id(codec))
        if found is None:
            found = self._held[id(codec)] = (codec, _dumps(list(codec.identity())))
        return found[1]


def _form(text: str) -> str:
    """``text`` as it stands in a form: its ``%`` doubled (a form is filled by ``%``)."""
    return text.replace("%", "%%")


_STR = json.encoder.encode_basestring_ascii  # how json.dumps writes a string (ensure_ascii, its default)
_CONSTANTS: Mapping[bool | None, str] = MappingProxyType({None: "null", True: "true", False: "false"})
# A record's fields in JSON's sorted order; those each tensor has of its own (holes in its form, filled in this
# order: sorted too); those recorded only when set (None, or for out_codec and carried plain and empty).
_FIELDS = tuple(sorted(f.name for f in fields(TensorPlan)))
_OWN = ("carried", "inputs", "name", "nbytes", "shape", "shard")
_LATER_FIELDS = frozenset({"copy_of", "experts", "blocks"})
_SHARED = attrgetter(*(name for name in _FIELDS if name not in _OWN))

