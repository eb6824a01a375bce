"""A GGUF output in the plan (``--out-type gguf``): every output tensor's GGUF name, type and transform, and the
file's header — key-values, tensor infos, every offset and the file's size — fixed before the first tensor is
merged, so the shard writer writes each tensor at its offset and a resume finds the same bytes planned. With
``--gguf-split-max-size`` the output is gguf-split's files (``model-00001-of-0000N.gguf``, ``gguf.md`` §1), each a
complete GGUF and its own shard: the first holds every key-value, the others only the ``split.*`` keys.

Each file is written in place, in units (:attr:`~resumerge.merge.plan.merge_plan.ShardPlan.units`): its header, then
groups of consecutive tensors of at most ``--out-shard-size`` bytes (a larger tensor alone), each journaled once it
is durable, so that an interrupted run loses at most the unit being written (:func:`unit_counts`).

llama.cpp's conventions (``gguf.md`` §2-4): each matrix in the type llama.cpp's quantizer picks for ``--gguf-type``
(:mod:`.gguftypes`), norms, 1-D tensors and routers F32; the family's hyperparameter keys from the
output's config.json; the ``tokenizer.*`` keys (vocabulary, merges, chat template) copied with their types from a
GGUF parent, or built from the donor's tokenizer files when no parent is a GGUF (``hfvocab``). A mixture of experts'
routed projections are stacked per layer as the converter stacks them (:mod:`.ggufstacks`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from resumerge.errors import ModelInputError, UsageError
from resumerge.inputs.gguf.ggmltypes import TYPES
from resumerge.inputs.gguf.header import read_gguf_header
from resumerge.inputs.gguf.hparams import gguf_hparams
from resumerge.inputs.gguf.model import gguf_module
from resumerge.inputs.gguf.names import (
    ARCH_OF,
    NORM_MINUS_ONE,
    UNPERMUTE_Q,
    check_routing,
    gguf_metadata,
    gguf_name,
    transform,
)
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.architecture import dense_mlp_layers
from resumerge.merge.plan.ggufbudget import Target, check_target, chosen_patterns
from resumerge.merge.plan.ggufstacks import WRITTEN, place_tensors
from resumerge.merge.plan.ggufswitches import imatrix_keys, overridden, parse_override_kv
from resumerge.merge.plan.gguftypes import (
    MIXES,
    OVERRIDE_TYPES,
    ModelFacts,
    TypeChoices,
    parse_tensor_types,
    reads_matrix,
    requires_imatrix,
    tensor_type,
)
from resumerge.merge.plan.merge_plan import ShardPlan, TensorPlan
from resumerge.outputs.containers import GgufChoices, GgufFile
from resumerge.outputs.gguf.layout import ARRAY, BOOL, F32, I32, STRING, U16, U32, TensorInfo, Value, plan_layout
from resumerge.outputs.gguf.outcodec import GgufOutCodec
from resumerge.outputs.gguf.stackcodec import GgufStackCodec

GGUF_NAME = "model.gguf"
SPLIT_NAME = "model-{:05d}-of-{:05d}.gguf"  # gguf-split's (llama_split_path), numbered from 1
_KINDS = MappingProxyType({"u32": U32, "f32": F32})
# A key-value an output sets over the one made or read (general.name, a tokenizer's added tokens).
OwnValue = str | bool | int


def _attention_widths(tensors: Mapping[str, TensorPlan]) -> tuple[int, int] | None:
    """Layer 0's query and key widths (its q_proj and k_proj rows), or None where the output has neither."""
    q, k = (tensors.get(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qk")
    return (q.shape[0], k.shape[0]) if q is not None and k is not None and q.shape and k.shape else None


def gguf_output(tensors: Mapping[str, TensorPlan], out_config: Mapping[str, Any], models: Mapping[str, ModelInput],
                order: list[str], gguf: GgufFile, template: str | None = None, last: Collection[str] = (),
                unit_size: int | None = None, keys: Mapping[str, OwnValue] = MappingProxyType({})
                ) -> tuple[tuple[ShardPlan, ...], dict[str, TensorPlan], dict[str, bytes]]:
    """The GGUF file ``gguf`` (its type, split and the user's choices) of an output of ``tensors`` whose config.json
    is ``out_config`` (or its gguf-split's files of at most ``gguf.split_max_size`` tensor bytes each:
    :func:`split_files`), its tokenizer keys from the first GGUF model of ``order`` (model keys, the donor first;
    none: built from the donor's tokenizer files) with the config's chat ``template`` (None: the parent's), and
    ``keys`` set over the ones made or read (:func:`own_keys`: a transplant's name and the BOS its tokenizer adds);
    the tensors with their GGUF codec and shard, and each shard's header. A
    mixture of experts' routed projections are stacked as llama.cpp stores them (:mod:`.ggufstacks`); the tensors
    named in ``last`` come last in the file (a prompt pass's routers). Each file's tensors are written in units of
    at most ``unit_size`` bytes (:func:`unit_counts`; None: one unit after the header). Each tensor's type is the
    one llama.cpp's quantizer gives it in a ``gguf_type`` file with the user's ``choices``
    (:func:`~resumerge.merge.plan.gguftypes.tensor_type`).
    Raises :class:`ModelInputError` (exit 2, before anything is written) for a family, a tensor or a tokenizer it
    cannot write, or a config.json without a key the family needs or with a value of the wrong type
    (:func:`~resumerge.inputs.gguf.hparams.gguf_hparams`)."""
    gguf_type, split_max_size, choices = gguf.gguf_type, gguf.split_max_size, gguf.choices
    model_type = out_config.get("model_type")
    arch = ARCH_OF.get(str(model_type))
    if arch is None:
        raise ModelInputError(f"a GGUF output of a {model_type} model, which resumerge cannot write yet (it writes "
                              f"{WRITTEN})", hint="write it as safetensors")
    if gguf_type not in MIXES:
        raise ModelInputError(f"--gguf-type {gguf_type}: one of {', '.join(MIXES)}")
    rope = out_config.get("rope_scaling") or out_config.get("rope_parameters") or {}
    if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ModelInputError(f"a GGUF output of a model with {rope.get('rope_type', rope.get('type'))} rope "
                              "scaling, which resumerge cannot write yet", hint="write it as safetensors")
    # The keys the writer reads, checked (and num_experts_per_tok defaulted as transformers does) before any is used.
    out_config = gguf_hparams(out_config, _attention_widths(tensors))
    dense = dense_mlp_layers(out_config)
    # a mixture of experts llama.cpp would route otherwise: refused before writing
    check_routing(arch, out_config, dense[1] if dense is not None else ())
    # The tokenizer keys: copied from the first GGUF parent, else built from the donor's tokenizer files.
    source = next((models[k] for k in order if models[k].gguf is not None), models[order[0]])
    # The file's types as llama.cpp's quantizer picks them (resumerge.merge.plan.gguftypes): its head's is its own, and
    # a tied embedding is the head.
    tied = not any(gguf_name(arch, n) == "output.weight" for n in tensors if n.endswith("lm_head.weight"))
    facts = _facts(arch, out_config, tied)
    wanted = _type_choices(choices)
    weights = (Importance.computed(choices.imatrix, choices.imatrix_texts) if choices.computed
               else Importance.read(choices.imatrix))
    encoding = _Encoding(arch, gguf_type, out_config, facts, wanted, weights)
    entries = place_tensors(tensors, arch, out_config, encoding.encoded, last)
    weights.check_used([i.name for e in entries for i in e.infos])
    placed = {name: tp for entry in entries for name, tp in entry.tensors}
    overrides = [parse_override_kv(spec) for spec in choices.override_kv]
    # the run's own keys (a transplant's name, the BOS its tokenizer adds) in place; the user's overrides and the
    # imatrix keys after them, as llama-quantize appends them
    # a matrix computed for a release's other files is not named by a file whose types read none (a Q8_0 beside a
    # Q4_K_M): that file is the one its type alone writes; a user's --imatrix file is named as llama-quantize does
    named = weights.keys() if not weights.later or reads_matrix(gguf_type) else []
    metadata = overridden(own_keys(_metadata(arch, out_config, gguf_type, source, template), keys),
                          overrides + named)
    whole = [TensorInfo(e.infos[0].name, e.infos[0].shape, e.infos[0].ggml_type, sum(i.nbytes for i in e.infos))
             for e in entries]  # an entry is split as one tensor
    groups = split_files(whole, split_max_size)
    if len(groups) == 1:
        layout = plan_layout(metadata, [i for e in entries for i in e.infos])
        if choices.target_size is not None or choices.target_bpw is not None:  # split: refused by the API
            check_target(placed, layout.file_size, gguf_type, Target(choices.target_size, choices.target_bpw),
                         choices.chosen)
        shard = ShardPlan(GGUF_NAME, tuple(placed), layout.file_size, unit_counts(tuple(placed), placed, unit_size))
        return (shard,), {n: tp.in_shard(GGUF_NAME) for n, tp in placed.items()}, {GGUF_NAME: layout.header}
    shards, headers, planned = [], {}, {}
    at = 0
    for i, group in enumerate(groups):
        name = SPLIT_NAME.format(i + 1, len(groups))
        mine = entries[at:at + len(group)]
        at += len(group)
        split = [("split.no", Value(U16, i)), ("split.count", Value(U16, len(groups))),
                 ("split.tensors.count", Value(I32, sum(len(e.infos) for e in entries)))]
        layout = plan_layout([*(metadata if i == 0 else []), *split], [info for e in mine for info in e.infos])
        members = tuple(n for e in mine for n, _ in e.tensors)
        shards.append(ShardPlan(name, members, layout.file_size, unit_counts(members, placed, unit_size)))
        headers[name] = layout.header
        planned.update({n: placed[n].in_shard(name) for n in members})
    return tuple(shards), planned, headers


def split_files(infos: list[TensorInfo], max_size: int | None) -> list[list[TensorInfo]]:
    """``infos`` (in data order) split as gguf-py's writer and gguf-split split them: a tensor starts a new file
    when the current one holds a tensor already and its tensors' bytes (unpadded) and this one's would exceed
    ``max_size``; a tensor larger than ``max_size`` gets a file of its own. None: one file."""
    groups: list[list[TensorInfo]] = [[]]
    held = 0
    for info in infos:
        if max_size is not None and groups[-1] and held + info.nbytes > max_size:
            groups.append([])
            held = 0
        groups[-1].append(info)
        held += info.nbytes
    return groups


def unit_counts(names: tuple[str, ...], tensors: Mapping[str, TensorPlan], max_size: int | None) -> tuple[int, ...]:
    """How many of the output tensors ``names`` (in data order) each unit of their file holds: grouped as
    :func:`split_files` groups tensors into files, by stored bytes, at most ``max_size`` a unit (a larger tensor
    alone; None: one unit)."""
    counts: list[int] = []
    held = 0
    for name in names:
        size = tensors[name].nbytes
        if not counts or (max_size is not None and held + size > max_size):
            counts.append(0)
            held = 0
        counts[-1] += 1
        held += size
    return tuple(counts)


def _facts(arch: str, config: Mapping[str, Any], tied: bool) -> ModelFacts:
    """What llama.cpp's type rules read of the output's model (``tied``: it has no head of its own)."""
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    layers = int(config.get("num_hidden_layers") or 1)
    return ModelFacts(tied=tied, experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
                      layers=layers, gqa=heads // kv, is_70b=arch == "llama" and layers == 80 and heads != kv)


def _type_choices(choices: GgufChoices) -> TypeChoices:
    """The user's GGUF type options as llama.cpp's rules take them (checked by the API already)."""
    return TypeChoices(parse_tensor_types(chosen_patterns(choices.chosen) + choices.tensor_types),
                       OVERRIDE_TYPES[choices.output_type] if choices.output_type else -1,
                       OVERRIDE_TYPES[choices.token_embedding_type] if choices.token_embedding_type else -1,
                       choices.imatrix is not None, choices.pure)


@dataclass(frozen=True)
class Importance:
    """The ``--imatrix`` file of a plan (``path`` "" for none) and its entries' sizes, by GGUF tensor name; or
    (``computed``) where the run writes the matrix it computes on the merge (``--imatrix-texts``): every weight of
    the decoder blocks has its entry there, of its own size."""

    path: str = ""
    sizes: Mapping[str, int] = field(default_factory=dict)
    later: bool = False
    # the dataset the file names (None: none) and its chunk count, for the quantize.imatrix.* keys
    dataset: str | None = None
    chunks: int = 0

    @classmethod
    def computed(cls, path: str | None, texts: str | None) -> Importance:
        assert path is not None, "the API names where a computed matrix goes"
        return cls(path, later=True, dataset=texts)

    @classmethod
    def read(cls, path: str | None) -> Importance:
        if path is None:
            return cls()
        from resumerge.outputs.gguf.imatrix import matrix_facts, read_imatrix

        entries = read_imatrix(path)
        dataset, chunks = matrix_facts(path, entries)
        return cls(path, {name: values.size for name, values in entries.items()}, dataset=dataset, chunks=chunks)

    def keys(self) -> list[tuple[str, Value]]:
        """The ``quantize.imatrix.*`` keys llama-quantize writes for the user's file (none without one); for a
        matrix computed on the merge (by the run's first phase, after the plan), its name and texts' (base names),
        its two counts written when the encoding lays the file out (:meth:`GgufFile.layout
        <resumerge.outputs.containers.GgufFile.layout>`: U32s, so no offset moves)."""
        if not self.path:
            return []
        if self.later:
            return imatrix_keys(self.path, self.dataset, 0, 1)
        return imatrix_keys(self.path, self.dataset, len(self.sizes), self.chunks)

    def for_tensor(self, target: str, columns: int, experts: int, ggml_type: int) -> str:
        """The file whose entry weights ``target`` (rows of ``columns``, ``experts`` slices) in ``ggml_type`` ("":
        none: no file, a type that takes no weights, or no entry, as llama-quantize goes on without one). Raises
        :class:`ModelInputError` for an entry of another size (token_embd's is skipped, as llama-quantize skips
        it)."""
        from resumerge.outputs.gguf.encoders import WEIGHTED

        if ggml_type not in WEIGHTED:
            return ""
        if self.later:  # measured on this very output: a blocks' weight has its entry (token_embd and output none)
            return self.path if target.startswith("blk.") else ""
        size = self.sizes.get(target)
        if size is None:
            return ""
        if size != columns * experts:
            if target == "token_embd.weight":
                return ""
            raise ModelInputError(f"--imatrix {self.path}: its entry {target} has {size} values, the output's "
                                  f"tensor {columns * experts} ({experts} x {columns} columns)",
                                  hint="give the importance matrix measured on this model")
        return self.path

    def check_used(self, names: Collection[str]) -> None:
        """Raises :class:`ModelInputError` when the file names none of the output's tensors (another model's)."""
        if self.path and not self.later and not set(self.sizes) & set(names):
            shown = ", ".join(sorted(self.sizes)[:2])
            raise ModelInputError(f"--imatrix {self.path}: none of its {len(self.sizes)} entries ({shown}, ...) "
                                  "names a tensor of this output", hint="give the importance matrix measured on "
                                                                        "this model")


@dataclass(frozen=True)
class _Encoding:
    """What each tensor of one GGUF file is encoded by: the family (``arch``), the ``--gguf-type`` ``mix``, the
    output's ``config``, the model's ``facts`` the type rules read, the user's type ``choices`` and the importance
    matrix (``weights``)."""

    arch: str
    mix: str
    config: Mapping[str, Any]
    facts: ModelFacts
    choices: TypeChoices
    weights: Importance

    def encoded(self, tp: TensorPlan, target: str, *, expert: int = -1, up_name: str = "") -> TensorPlan:
        """``tp`` written as GGUF tensor ``target`` (expert ``expert``'s slice of it, or with ``up_name`` a fused
        gate_up stack's gate half, its up half to ``up_name``: :mod:`resumerge.outputs.gguf.stackcodec`) in the type
        llama.cpp's quantizer picks in a ``mix`` file (:func:`~resumerge.merge.plan.gguftypes.tensor_type`) with the
        user's ``choices``, with the family's transform."""
        how = transform(self.arch, target)
        mix, weights = self.mix, self.weights
        chosen = tensor_type(target, tp.shape, mix, self.facts, self.choices)
        ggml, llama = chosen.written, -1 if chosen.llama == chosen.written else chosen.llama
        head_rows = 1
        if how and how != NORM_MINUS_ONE:
            heads = int(self.config["num_attention_heads"] if how == UNPERMUTE_Q else
                        self.config.get("num_key_value_heads") or self.config["num_attention_heads"])
            head_rows = tp.shape[0] // heads
        columns = tp.shape[-1]
        stacked = expert >= 0 or len(tp.shape) == 3
        experts = self.facts.experts if stacked and self.facts.experts else 1
        imatrix = weights.for_tensor(target, columns, experts, ggml)
        if up_name:
            imatrix = imatrix or weights.for_tensor(up_name, columns, experts, ggml)
        if not imatrix and requires_imatrix(target, ggml, mix) and not weights.path:
            raise UsageError(f"--gguf-type {mix}: llama.cpp's quantizer writes {target} as {TYPES[ggml].name} "
                             "only with an importance matrix", hint="give --imatrix FILE (llama-imatrix's) or "
                                                                    "--imatrix-texts FILE (texts to compute it on "
                                                                    "the merge from)")
        if not imatrix and requires_imatrix(target, ggml, mix):
            raise ModelInputError(f"--gguf-type {mix}: llama.cpp's quantizer writes {target} as "
                                  f"{TYPES[ggml].name} only with an importance matrix, and --imatrix "
                                  f"{weights.path} has no entry for it", tensor=target,
                                  hint="give the importance matrix measured on this model")
        codec: GgufOutCodec = GgufOutCodec(target, ggml, how, head_rows, llama, imatrix)
        if expert >= 0 or up_name:
            codec = GgufStackCodec(target, ggml, how, head_rows, llama, imatrix, expert=expert, up_name=up_name)
        return replace(tp, out_codec=codec, carried=()).sized()


def _metadata(arch: str, config: Mapping[str, Any], gguf_type: str, source: ModelInput,
              template: str | None) -> list[tuple[str, Value]]:
    """The output's key-values: general, the family's hyperparameters, the GGUF parent's tokenizer keys."""
    kv: list[tuple[str, Value]] = [("general.architecture", Value(STRING, arch)),
                                   ("general.type", Value(STRING, "model")),
                                   ("general.name", Value(STRING, "resumerge merge")),
                                   ("general.file_type", Value(U32, MIXES[gguf_type].file_type))]
    if TYPES[MIXES[gguf_type].default].is_block:
        kv.append(("general.quantization_version", Value(U32, 2)))
    kv += [(key, Value(_KINDS[kind], value)) for key, (kind, value) in gguf_metadata(arch, config)]
    if source.gguf is None:
        from resumerge.merge.plan.tokenizer_plan import tokenizer_dir
        from resumerge.outputs.gguf.hfvocab import tokenizer_keys

        return kv + tokenizer_keys(tokenizer_dir(source), int(config["vocab_size"]), template)
    header = source.gguf_header
    if header is None:  # opened without its header kept
        gguf = gguf_module()
        header = read_gguf_header(source.directory / source.gguf, {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()})
    for key, value in header.metadata.items():
        if not key.startswith("tokenizer.") or (template is not None and key == "tokenizer.chat_template"):
            continue
        kind, sub = header.kinds[key]
        if kind == ARRAY:
            items = value if isinstance(value, list) else value.tolist()
            kv.append((key, Value(ARRAY, items, sub)))
        else:
            kv.append((key, Value(kind, bool(value) if kind == BOOL else value)))
    if template is not None:
        kv.append(("tokenizer.chat_template", Value(STRING, template)))
    return kv


def own_keys(metadata: list[tuple[str, Value]], keys: Mapping[str, OwnValue]) -> list[tuple[str, Value]]:
    """``metadata`` with ``keys`` set over it (in place of the same key, else after the rest): a string as
    STRING, a bool as BOOL, an int (a token id) as U32, as llama.cpp's converter writes each."""
    def value(v: OwnValue) -> Value:
        return Value(BOOL, v) if isinstance(v, bool) else Value(U32, v) if isinstance(v, int) else Value(STRING, v)

    done = [(k, value(keys[k]) if k in keys else v) for k, v in metadata]
    present = {k for k, _ in metadata}
    return done + [(k, value(v)) for k, v in keys.items() if k not in present]
