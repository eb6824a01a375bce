"""The output container: what a run's output files are — safetensors shards beside their index, config.json and
tokenizer files (:class:`SafetensorsShards`), one GGUF file or gguf-split's files holding the config and the
tokenizer themselves (:class:`GgufFile`), or a PEFT adapter whose side files the plan made
(:class:`PeftAdapter`).

The planner picks one by :func:`container_for` (the class a row of :data:`resumerge.config.outformats.OUT_FORMATS`
names for ``--out-type``, given the plan's options, of which each container reads its own) and carries it on the
plan (``Plan.container``); it owns the files' byte layout, which side files are written (and the bytes of those it
planned itself), what the fingerprint records beyond the tensors, the estimate's fact about the files, the model
card's tags and section, and ``verify``'s integrity rule. Nothing outside this module asks which container it has.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from resumerge.config.outformats import out_format
from resumerge.config.passplace import named
from resumerge.inputs.safetensors_format import ShardLayout, layout_shard

if TYPE_CHECKING:
    from resumerge.inputs.codecs.protocol import OutPart

# A stored part of an output file as a layout places it: (stored name, safetensors dtype, shape).
Part = tuple[str, str, tuple[int, ...]]


def _hashes(files: Mapping[str, bytes]) -> dict[str, str]:
    return {n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())}


@dataclass(frozen=True)
class GgufChoices:
    """A GGUF output's type options beyond ``--gguf-type`` (:class:`~resumerge.merge.plan.merge_plan.PlanOptions`'
    ``gguf_tensor_types``, ``gguf_output_type``, ``gguf_token_embedding_type``, ``imatrix``), as given."""

    tensor_types: tuple[str, ...] = ()
    output_type: str | None = None
    token_embedding_type: str | None = None
    imatrix: str | None = None
    # --imatrix-texts: the texts the importance matrix at ``imatrix`` is computed on the merge from (before the
    # encoding, by the run); None: ``imatrix`` is the user's file.
    imatrix_texts: str | None = None
    # --gguf-override-kv KEY=TYPE:VALUE key-values, --pure
    override_kv: tuple[str, ...] = ()
    pure: bool = False
    # --gguf-target-size (bytes) or --gguf-target-bpw, and the types chosen for it (NAME=type pairs; none: not yet)
    target_size: int | None = None
    target_bpw: float | None = None
    chosen: tuple[str, ...] = ()

    @property
    def computed(self) -> bool:
        """Whether the importance matrix is computed on the merge (not yet there when the plan is made)."""
        return self.imatrix_texts is not None


# no type options: every tensor as llama.cpp's mix picks it, no importance matrix
NO_CHOICES = GgufChoices()


@dataclass(frozen=True)
class OutputContainer:
    """What a container answers, each answer by default the safetensors shards' (:class:`SafetensorsShards`). A
    value (a frozen dataclass: it travels on the plan, and a stored plan is unpickled field by field)."""

    name: ClassVar[str] = "safetensors"
    # The model card's tags beyond the ones every card has.
    card_tags: ClassVar[tuple[str, ...]] = ()
    # Whether the files hold the config and the tokenizer themselves (no config.json, index or tokenizer files).
    self_contained: ClassVar[bool] = False
    # Whether ``verify`` also reads a finished output as a loader does (its config.json and safetensors headers:
    # every quantized weight with its companions); False where the format lives in the files' own headers,
    # re-hashed with them.
    loader_readable: ClassVar[bool] = True
    # Whether a merge read without being written (``eval``'s and ``evolve``'s unwritten merge) may stand for this
    # container: it serves the merge's values under their own names, as these files hold them; False where the
    # files store them otherwise (a GGUF's names and blocks).
    unwritten_reads: ClassVar[bool] = True
    # What the last phase of a run writing these files is called (``status`` names it beside the phases before it).
    writing: ClassVar[str] = "the merge"

    def layout(self, file: str, parts: Sequence[Part], file_size: int) -> ShardLayout:
        """The byte layout of output file ``file`` holding the stored ``parts`` (in data order; those of every file
        written with it, in a GGUF release: :meth:`parts_in`) in ``file_size`` bytes, as the writer must produce
        it."""
        return layout_shard({name: (dtype, shape) for name, dtype, shape in parts})

    def parts_in(self, file: str, parts: tuple[OutPart, ...]) -> tuple[OutPart, ...]:
        """Those of an output tensor's stored ``parts`` that file ``file`` holds: all of them, but in files one
        computation writes together (:meth:`lead`)."""
        return parts

    def lead(self, file: str) -> str:
        """The file whose computation writes file ``file`` too, each tensor computed once for both (``file``
        itself, but in a GGUF release: its first file, each file holding its own parts of every tensor)."""
        return file

    def fingerprint_extras(self) -> dict[str, Any]:
        """What the plan's fingerprint records of the container beyond its tensors and shards (nothing for
        safetensors shards, so a merge's fingerprint is what it always was)."""
        return {}

    def side_files(self) -> Mapping[str, bytes]:
        """The side files the plan made itself, by name (written instead of the merge's config, card and
        tokenizer); empty: the merge's own."""
        return {}

    def writes_index(self, files: int) -> bool:
        """Whether an index of the tensors' files is written beside ``files`` of them (safetensors: when sharded)."""
        return files > 1 and not self.self_contained

    def tokenizer_note(self) -> str | None:
        """Where the output's tokenizer is when the plan names no tokenizer files (None: nowhere)."""
        return None

    def files_fact(self) -> str | None:
        """The estimate's fact about the output's files (None: the shard size's, as the estimate says it)."""
        return None

    def card_lines(self, files: Sequence[str], out_config: Mapping[str, Any]) -> list[str]:
        """The model card's section about the files (``files``: their names; ``out_config``: the output's
        config.json); none for safetensors."""
        return []

    @classmethod
    def holds(cls, files: Iterable[str]) -> bool:
        """Whether committed output files named ``files`` are this container's (what ``verify`` knows of a run)."""
        return True

    @classmethod
    def chosen(cls, options: Any) -> OutputContainer:
        """The container ``--out-type`` names, given the plan's ``options``
        (:class:`~resumerge.merge.plan.merge_plan.PlanOptions`, of which it reads its own: its row's in
        :data:`resumerge.config.outformats.OUT_FORMATS`), its files not laid out yet (the planner lays them out)."""
        return cls()


@dataclass(frozen=True)
class SafetensorsShards(OutputContainer):
    """Safetensors shards (``model-0000i-of-0000N.safetensors`` or the parent's names), their index when there are
    several, config.json and the tokenizer files: every answer the default one."""


SAFETENSORS = SafetensorsShards()


@dataclass(frozen=True)
class GgufFile(OutputContainer):
    """``--out-type gguf``: one GGUF file, or gguf-split's files of at most ``split_max_size`` tensor bytes each
    (None: one), matrices in ``gguf_type``; ``headers``: each file's planned header bytes (key-values, tensor infos,
    padding), fixed by the planner (:mod:`resumerge.merge.plan.ggufout`), its tensors at the offsets they fix."""

    name: ClassVar[str] = "gguf"
    card_tags: ClassVar[tuple[str, ...]] = ("gguf",)
    self_contained: ClassVar[bool] = True
    loader_readable: ClassVar[bool] = False
    unwritten_reads: ClassVar[bool] = False
    writing: ClassVar[str] = "the merge and its GGUF encoding"

    gguf_type: str = "f16"
    split_max_size: int | None = None
    choices: GgufChoices = NO_CHOICES
    headers: Mapping[str, bytes] = field(default_factory=dict, compare=False, repr=False)

    def layout(self, file: str, parts: Sequence[Part], file_size: int) -> ShardLayout:
        from resumerge.outputs.gguf.layout import shard_layout

        header = self.headers[file]
        if self.choices.computed and self.choices.imatrix is not None:  # the counts of the matrix computed first
            from resumerge.outputs.gguf.imatrix import with_counts

            header = with_counts(header, self.choices.imatrix)
        return shard_layout(header, list(parts), file_size)

    def fingerprint_extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = {"gguf_headers": _hashes(self.headers)}
        if self.choices.computed:  # the texts make the matrix: a changed texts file is another plan
            texts = Path(self.choices.imatrix_texts or "")
            if not texts.is_file():
                from resumerge.errors import ModelInputError

                raise ModelInputError(f"--imatrix-texts {texts}: the texts the importance matrix is computed from are "
                                      "gone", hint="put the file back as it was (or start over with run --restart)")
            extras["imatrix_texts"] = hashlib.sha256(texts.read_bytes()).hexdigest()
        elif self.choices.imatrix is not None:  # its values change the bytes: a changed file is another plan
            extras["imatrix"] = hashlib.sha256(Path(self.choices.imatrix).read_bytes()).hexdigest()
        return extras

    def tokenizer_note(self) -> str | None:
        return "tokenizer in the GGUF"

    def files_fact(self) -> str | None:
        from resumerge.machine.memory.sizes import format_size

        return ("one GGUF file" if self.split_max_size is None else
                f"gguf-split's files of at most {format_size(self.split_max_size)} of tensors each "
                "(--gguf-split-max-size)")

    @classmethod
    def chosen(cls, options: Any) -> OutputContainer:
        gguf_type, split_max_size, choices = options.gguf_type, options.gguf_split_max_size, gguf_choices(options)
        if "," in gguf_type:  # a list of types: a release, one file of each
            return GgufRelease(gguf_type, split_max_size, choices)
        return cls(gguf_type, split_max_size, choices)

    def card_lines(self, files: Sequence[str], out_config: Mapping[str, Any]) -> list[str]:
        from resumerge.inputs.gguf.names import ARCH_OF
        from resumerge.outputs.gguf.quality import quality_line

        written = (f"`{files[0]}`" if len(files) == 1 else
                   f"{len(files)} gguf-split files (`{files[0]}` … ; llama.cpp loads the first)")
        kind = self.gguf_type.upper()
        model_type = str(out_config.get("model_type"))
        experts = out_config.get("num_experts") or out_config.get("num_local_experts")
        stacked = (f"; the {experts} experts of each layer stacked per projection (`blk.N.ffn_*_exps`)" if experts
                   else "")
        fallback = "; rows that are not whole 32-value blocks F16" if kind == "Q8_0" else ""
        weighted = self._importance_line()
        return ["## GGUF", "",
                f"Written for llama.cpp as {written}: architecture `{ARCH_OF.get(model_type, model_type)}`, matrices "
                f"{kind} (`--gguf-type {self.gguf_type}`{fallback}), norms, 1-D tensors and routers F32{stacked}.",
                "", *([quality, ""] if (quality := quality_line(self.gguf_type, self.choices.imatrix is not None))
                      else []),
                *([weighted, ""] if weighted else [])]

    def _importance_line(self) -> str | None:
        """Which importance matrix weighted the quantizer (None: none): the file's sha256, or the texts the matrix
        was computed on the merge from."""
        path = self.choices.imatrix
        if path is None:
            return None
        if not self.choices.computed:
            digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            return f"Importance matrix: `{Path(path).name}` (`--imatrix`, sha256 `{digest}`)."
        from resumerge.outputs.gguf.imatrix import computed_counts

        texts = Path(self.choices.imatrix_texts or "").name
        found = computed_counts(path)
        counted = f"{found[0]} texts, {found[1]} tokens" if found is not None else "its texts"
        return (f"Importance matrix: computed on the merge from {counted} of `{texts}` (`--imatrix-texts`), in a "
                "forward pass over the merge never written.")

    @classmethod
    def holds(cls, files: Iterable[str]) -> bool:
        return any(name.endswith(".gguf") for name in files)


@dataclass(frozen=True)
class GgufRelease(GgufFile):
    """``--gguf-type`` given a list (``q8_0,q6_k,q4_k_m``): one GGUF file of each type, named as publishers name
    them (``NAME-Q4_K_M.gguf``), each holding the bytes a run of that type alone writes, all written from one
    computation of each tensor (:mod:`resumerge.outputs.gguf.releasecodec`): the first file's pass writes every
    file, each its own stored parts. ``headers`` by file, as a single file's; ``facts``: each file's (name, type,
    size, bits per weight), for the card."""

    name: ClassVar[str] = "gguf-release"

    stem: str = "model"
    facts: tuple[tuple[str, str, int, float], ...] = field(default=(), compare=False, repr=False)

    @property
    def gguf_types(self) -> tuple[str, ...]:
        """The types of the release, in the order given."""
        return tuple(self.gguf_type.split(","))

    def file_names(self) -> tuple[str, ...]:
        """The release's files, one per type in order: ``STEM-TYPE.gguf``, the type as llama.cpp spells it."""
        return tuple(f"{self.stem}-{kind.upper()}.gguf" for kind in self.gguf_types)

    def layout(self, file: str, parts: Sequence[Part], file_size: int) -> ShardLayout:
        from resumerge.outputs.gguf.releasecodec import parts_of_file

        return super().layout(file, parts_of_file(file, parts, lambda p: p[0]), file_size)

    def parts_in(self, file: str, parts: tuple[OutPart, ...]) -> tuple[OutPart, ...]:
        from resumerge.outputs.gguf.releasecodec import parts_of_file

        return tuple(parts_of_file(file, parts, lambda p: p.name))

    def lead(self, file: str) -> str:
        return self.file_names()[0]

    def files_fact(self) -> str | None:
        return f"{len(self.gguf_types)} GGUF files, one per type ({', '.join(self.file_names())})"

    def card_lines(self, files: Sequence[str], out_config: Mapping[str, Any]) -> list[str]:
        from resumerge.inputs.gguf.names import ARCH_OF
        from resumerge.machine.memory.sizes import format_size

        model_type = str(out_config.get("model_type"))
        weighted = self._importance_line()
        return ["## GGUF", "",
                f"Written for llama.cpp as {len(self.facts)} files, one per type (`--gguf-type {self.gguf_type}`), "
                f"each the bytes a run of its type alone writes: architecture `{ARCH_OF.get(model_type, model_type)}`"
                ", norms, 1-D tensors and routers F32.", "",
                "| file | type | size | bits per weight |", "|---|---|---|---|",
                *(f"| `{file}` | {kind.upper()} | {format_size(size)} | {bpw:.2f} |"
                  for file, kind, size, bpw in self.facts), "",
                *([weighted, ""] if weighted else [])]


@dataclass(frozen=True)
class PeftAdapter(OutputContainer):
    """A PEFT adapter (an extracted one, or ``--out-adapter``'s merged one): its weights file, and the side files the
    plan made (``adapter_config.json``, the card), by name."""

    name: ClassVar[str] = "peft-adapter"

    files: Mapping[str, bytes] = field(default_factory=dict, compare=False, repr=False)

    def fingerprint_extras(self) -> dict[str, Any]:
        return {"side_files": _hashes(self.files)} if self.files else {}

    def side_files(self) -> Mapping[str, bytes]:
        return self.files


# Every container whose files ``verify`` may find, the most particular first.
CONTAINERS: tuple[type[OutputContainer], ...] = (GgufFile, SafetensorsShards)


def container_class(out_type: str) -> type[OutputContainer]:
    """The container class of ``--out-type out_type`` (its row of :data:`resumerge.config.outformats.OUT_FORMATS`;
    an adapter is its kind's own, or ``--out-adapter``'s). KeyError for no such format."""
    row = out_format(out_type)
    if row is None:
        raise KeyError(out_type)
    found: type[OutputContainer] = named(row.container)
    return found


def container_for(options: Any) -> OutputContainer:
    """The container the plan's ``options`` (:class:`~resumerge.merge.plan.merge_plan.PlanOptions`) write: their
    ``--out-type``'s, given them (it reads its own), its files not laid out yet (the planner lays them out)."""
    return container_class(options.out_type).chosen(options)


def gguf_choices(options: Any) -> GgufChoices:
    """The GGUF type options of a plan's ``options`` (:class:`~resumerge.merge.plan.merge_plan.PlanOptions`)."""
    return GgufChoices(tuple(options.gguf_tensor_types), options.gguf_output_type,
                       options.gguf_token_embedding_type, options.imatrix,
                       getattr(options, "imatrix_texts", None), tuple(getattr(options, "gguf_override_kv", ())),
                       bool(getattr(options, "gguf_pure", False)), getattr(options, "gguf_target_size", None),
                       getattr(options, "gguf_target_bpw", None), tuple(getattr(options, "gguf_chosen_types", ())))


def container_of(files: Iterable[str]) -> type[OutputContainer]:
    """The container whose files ``files`` (a run's committed output files) are."""
    names = list(files)
    return next(c for c in CONTAINERS if c.holds(names))
