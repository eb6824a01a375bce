"""The structure genome read and checked, and a candidate of it: a set of *edits* of the base model's decoder
layers (a block ``i..j−1`` repeated right after itself, or skipped), which makes its layer path and the
``slices:`` passthrough config ``run`` merges.

The genome (``genome:`` with ``kind: structure``)::

    genome:
      kind: structure
      model: PATH            # the base: every block is a range of its layers
      grow: 25               # a candidate has at most 25 % more layers than the base [default: 25]
      shrink: 0              # ... and at most this % fewer (skipped blocks; 0: none) [default: 0]
      repeat: [4, 26]        # the layers an edit may touch, first and last [default: every layer]
      pattern: rewrite       # rewrite: each layer keeps its source layer's type, written so in the output config;
                             # keep: a candidate whose layer types break the base's periodic pattern is refused
      beam_width: 4          # the beam over compositions: its width, its depth (edits beyond the first) and
      beam_depth: 1          # how many of the best single edits are composed with its members
      beam_edits: 8
      surrogate: 12          # optional: each beam round scores only the 12 children a surrogate ranks best
    tasks: [{nll: {texts: FILE}}, {kl: {parent: PATH, texts: FILE}}]
    held_out: [{nll: {texts: FILE}}]   # scored for the front's candidates once the search ends

Every problem is one :class:`~resumerge.errors.ConfigError` naming its YAML path, before any model is opened."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.config.merge_config import parse_documents
from resumerge.errors import ConfigError
from resumerge.runs.evolve.spec import Task, _known, _path, _tasks

_KEYS = ("kind", "model", "grow", "shrink", "repeat", "pattern", "beam_width", "beam_depth", "beam_edits",
         "surrogate")
_TOP = ("genome", "tasks", "held_out")
PATTERNS = ("rewrite", "keep")
REPEAT, SKIP = "repeat", "skip"
Edit = tuple[str, int, int]  # (REPEAT or SKIP, first layer, layer after the block)


@dataclass(frozen=True)
class StructureGenome:
    """What is searched (see the module's docstring): the base ``model``, the size bounds in percent, the layers
    edits may touch (``repeat``: first and last; None: every layer), the ``pattern`` rule and the beam's settings."""

    model: str
    grow: float = 25.0
    shrink: float = 0.0
    repeat: tuple[int, int] | None = None
    pattern: str = "rewrite"
    beam_width: int = 4
    beam_depth: int = 1
    beam_edits: int = 8
    surrogate: int | None = None  # each beam round scores the children a surrogate ranks best, this many


@dataclass(frozen=True)
class ShapeSpec:
    """A checked structure search: its genome, the tasks scored during the search, the ``held_out`` ones scored
    for the front, and the YAML ``text``."""

    genome: StructureGenome
    tasks: tuple[Task, ...]
    held_out: tuple[Task, ...]
    text: str

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def is_structure(text: str) -> bool:
    """Whether the evolve config ``text`` holds a structure genome (``genome.kind: structure``; not YAML, or any
    other: the parameter genome's reader judges it)."""
    try:
        docs = parse_documents(text, source="CONFIG")
    except ConfigError:
        return False
    genome = docs[0].get("genome") if len(docs) == 1 and isinstance(docs[0], dict) else None
    return isinstance(genome, dict) and genome.get("kind") == "structure"


def read_shape_spec(text: str, base_dir: Path | None = None) -> ShapeSpec:
    """The structure search in YAML ``text`` (paths relative to ``base_dir``); :class:`ConfigError` for the first
    problem, naming its YAML path."""
    doc: dict[str, Any] = parse_documents(text, source="CONFIG")[0]
    _known(doc, _TOP, "")
    if "tasks" not in doc:
        raise ConfigError("CONFIG has no tasks", yaml_path="tasks", hint="nll or kl tasks score a structure")
    genome = _genome(doc["genome"], base_dir)
    tasks = _scored(_tasks(doc["tasks"], base_dir, False), "tasks")
    held = _scored(_tasks(doc["held_out"], base_dir, False), "held_out") if "held_out" in doc else ()
    return ShapeSpec(genome, tasks, held, text)


def _scored(tasks: tuple[Task, ...], where: str) -> tuple[Task, ...]:
    for i, task in enumerate(tasks):
        if task.kind == "lm-eval":
            raise ConfigError(f"task {task.name}: a structure search scores nll and kl tasks (lm-eval's: not yet)",
                              yaml_path=f"{where}[{i}]", hint="use {nll: {texts: FILE}} or {kl: {parent, texts}}")
    return tasks


def _genome(value: Any, base_dir: Path | None) -> StructureGenome:
    _known(value, _KEYS, "genome.")
    if "model" not in value:
        raise ConfigError("a structure genome names its base model", yaml_path="genome.model")
    model = _path(value["model"], "genome.model", base_dir)
    grow, shrink = (_percent(value.get(k, d), f"genome.{k}") for k, d in (("grow", 25), ("shrink", 0)))
    if shrink >= 100:
        raise ConfigError("must be below 100 (a candidate keeps a layer at least)", yaml_path="genome.shrink")
    repeat = value.get("repeat")
    if repeat is not None:
        if not (isinstance(repeat, list) and len(repeat) == 2 and all(_whole(v) for v in repeat)
                and 0 <= repeat[0] <= repeat[1]):
            raise ConfigError("must be [first, last]: two layer numbers, first ≤ last", yaml_path="genome.repeat")
        repeat = (repeat[0], repeat[1])
    pattern = value.get("pattern", "rewrite")
    if pattern not in PATTERNS:
        raise ConfigError(f"must be {' or '.join(PATTERNS)}", yaml_path="genome.pattern",
                          hint="rewrite: each layer keeps its source's type; keep: refuse a candidate that breaks "
                               "the base's pattern")
    beam = [value.get(k, d) for k, d in (("beam_width", 4), ("beam_depth", 1), ("beam_edits", 8))]
    for (key, floor), found in zip((("beam_width", 1), ("beam_depth", 0), ("beam_edits", 1)), beam):
        if not _whole(found) or found < floor:
            raise ConfigError(f"must be a whole number of {floor} or more", yaml_path=f"genome.{key}")
    surrogate = value.get("surrogate")
    if surrogate is not None and (not _whole(surrogate) or surrogate < 1):
        raise ConfigError("must be a whole number of 1 or more: the children a beam round scores",
                          yaml_path="genome.surrogate")
    return StructureGenome(model, grow, shrink, repeat, pattern, beam_width=beam[0], beam_depth=beam[1],
                           beam_edits=beam[2], surrogate=surrogate)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _percent(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1000:
        raise ConfigError("must be a percentage of the base's layers, 0 to 1000", yaml_path=where)
    return float(value)


@dataclass(frozen=True)
class Shape:
    """A candidate: its ``edits``, sorted, none overlapping another (the base: none)."""

    edits: tuple[Edit, ...] = ()

    @property
    def key(self) -> str:
        """The candidate in words (``base``; ``repeat 8-11``: layers 8 to 11 run twice; ``skip 3-4``)."""
        return ", ".join(f"{kind} {a}-{b - 1}" for kind, a, b in self.edits) or "base"

    def path(self, layers: int) -> list[int]:
        """The decoder layers the candidate runs, in order."""
        found: list[int] = []
        cursor = 0
        for kind, a, b in self.edits:
            if kind == REPEAT:
                found += [*range(cursor, b), *range(a, b)]
            else:
                found += range(cursor, a)
            cursor = b
        return found + list(range(cursor, layers))

    def with_edit(self, edit: Edit) -> Shape | None:
        """This candidate with ``edit`` too (None where it overlaps one of its edits)."""
        if any(edit[1] < b and a < edit[2] for _, a, b in self.edits):
            return None
        return Shape(tuple(sorted((*self.edits, edit), key=lambda e: (e[1], e[2], e[0]))))

    def to_json(self) -> list[list[Any]]:
        return [list(e) for e in self.edits]

    @classmethod
    def from_json(cls, doc: Sequence[Sequence[Any]]) -> Shape:
        return cls(tuple((str(k), int(a), int(b)) for k, a, b in doc))


def blocks(path: Sequence[int]) -> list[tuple[int, int]]:
    """``path`` as its runs of consecutive layers, each ``(first, after last)``: the slices' layer ranges."""
    found: list[tuple[int, int]] = []
    for layer in path:
        if found and found[-1][1] == layer:
            found[-1] = (found[-1][0], layer + 1)
        else:
            found.append((layer, layer + 1))
    return found


def shape_config(model: str, path: Sequence[int]) -> dict[str, Any]:
    """The merge config that writes the candidate of layer ``path``: a passthrough of the base's layer ranges (``run``
    gives each output layer its source layer's per-layer facts: :mod:`resumerge.merge.plan.outconfig`)."""
    return {"merge_method": "passthrough",
            "slices": [{"sources": [{"model": model, "layer_range": [a, b]}]} for a, b in blocks(path)]}


def single_edits(genome: StructureGenome, layers: int) -> list[Edit]:
    """Every single edit the genome allows on a base of ``layers`` layers, in order: each block ``i..j−1`` inside
    ``repeat`` repeated (within ``grow``) and skipped (within ``shrink``)."""
    first, last = genome.repeat if genome.repeat is not None else (0, layers - 1)
    last = min(last, layers - 1)
    most_added, most_dropped = int(layers * genome.grow / 100), int(layers * genome.shrink / 100)
    found: list[Edit] = []
    for a in range(first, last + 1):
        for b in range(a + 1, last + 2):
            if b - a <= most_added:
                found.append((REPEAT, a, b))
            if b - a <= most_dropped and b - a < layers:
                found.append((SKIP, a, b))
    return found


def within(genome: StructureGenome, shape: Shape, layers: int) -> bool:
    """Whether ``shape``'s size is within the genome's bounds."""
    size = len(shape.path(layers))
    return layers - int(layers * genome.shrink / 100) <= size <= layers + int(layers * genome.grow / 100)


def period(types: Sequence[str]) -> int:
    """The shortest period of the per-layer ``types`` (their length where they repeat no shorter pattern)."""
    n = len(types)
    return next(p for p in range(1, n + 1) if all(types[k] == types[k % p] for k in range(n)))


def keeps_pattern(types: Sequence[str] | None, path: Sequence[int]) -> bool:
    """Whether the layer path's types follow the base's periodic pattern (``types``: the base's per layer; None: one
    kind of layer, every path does)."""
    if not types:
        return True
    p = period(types)
    return all(types[layer] == types[k % p] for k, layer in enumerate(path))


def layer_types(config: Mapping[str, Any]) -> list[str] | None:
    """The base's ``layer_types`` as its config.json lists them (its text config's, for a wrapper config)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = text.get("layer_types") if isinstance(text, dict) else None
    return [str(t) for t in found] if isinstance(found, list) else None
