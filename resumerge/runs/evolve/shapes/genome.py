"""The structure genome read and checked, and a candidate of it: a set of *edits* of the base model's decoder
layers (a block ``i..j−1`` repeated right after itself, skipped, or swapped for the same layers of another model of
its family; a repeated or swapped block may come from another source and carry a scale on its output projections),
which makes its layer path and the ``slices:`` passthrough config ``run`` merges.

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
      sources: [PATH, ...]   # other models of the base's family (its layers' shapes): source 1, 2, ...
      scales: [1.0, 0.5]     # the multipliers a repeated or swapped block's output projections are tried at
      swap: 2                # blocks of at most 2 layers swapped for another source's or scaled [default: 0]
      scale_search: {evaluations: 12, sigma0: 0.2}   # CMA-ES over the scales of the front's members' blocks
    tasks: [{nll: {texts: FILE}}, {kl: {parent: PATH, texts: FILE}}, {name: arc_easy, metric: acc,none}]
    held_out: [{nll: {texts: FILE}}]   # scored for the front's candidates once the search ends
    limit: 100                         # lm-eval's settings of its tasks (as the parameter genome's)
    num_fewshot: 0
    apply_chat_template: false

A borrowed layer never begins or ends a path (``run`` takes the embeddings from the first slice's model, the final
norm and head from the last's: the base's, as the search scores them). Every problem is one
:class:`~resumerge.errors.ConfigError` naming its YAML path, before any model is opened."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from resumerge.config.merge_config import parse_documents
from resumerge.errors import ConfigError
from resumerge.runs.evolve.layercache import Borrowed, Layer, layer_of, scale_parameter
from resumerge.runs.evolve.spec import Task, _count, _flag, _known, _path, _tasks

_KEYS = ("kind", "model", "grow", "shrink", "repeat", "pattern", "beam_width", "beam_depth", "beam_edits",
         "surrogate", "sources", "scales", "swap", "scale_search")
_TOP = ("genome", "tasks", "held_out", "limit", "num_fewshot", "apply_chat_template")
PATTERNS = ("rewrite", "keep")
REPEAT, SKIP, SWAP = "repeat", "skip", "swap"


class Edit(NamedTuple):
    """An edit of the base's layers ``first..after−1``: ``kind`` (REPEAT, SKIP, SWAP); a repeated block's copy or a
    swapped block taken from ``source`` (0: the base), its output projections multiplied by ``scale``."""

    kind: str
    first: int
    after: int
    source: int = 0
    scale: float = 1.0

    @property
    def key(self) -> str:
        words = f"{self.kind} {self.first}-{self.after - 1}"
        return words + (f" from {self.source}" if self.source else "") + (
            f" ×{self.scale!r}" if self.scale != 1 else "")

    def copy(self, layer: int) -> Layer:
        """The path's entry for ``layer`` of the block's copy (a plain number: the base's own, unscaled)."""
        return layer if (self.source, self.scale) == (0, 1) else Borrowed(self.source, layer, self.scale)


@dataclass(frozen=True)
class ScaleSearch:
    """CMA-ES over the scales of the front's members' repeated and swapped blocks, after the structure search:
    ``evaluations`` candidates a member at most, the first step ``sigma0``, scales kept within ``bounds``."""

    evaluations: int = 12
    sigma0: float = 0.2
    bounds: tuple[float, float] = (0.0, 2.0)


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
    sources: tuple[str, ...] = ()  # other models of the base's family a block may come from (source 1, 2, ...)
    scales: tuple[float, ...] = (1.0,)  # each repeated or swapped block tried at each of these
    swap: int = 0  # the longest block swapped for another source's (or scaled), in layers
    scale_search: ScaleSearch | None = None


@dataclass(frozen=True)
class ShapeSpec:
    """A checked structure search: its genome, the tasks scored during the search, the ``held_out`` ones scored
    for the front, and the YAML ``text``."""

    genome: StructureGenome
    tasks: tuple[Task, ...]
    held_out: tuple[Task, ...]
    text: str
    limit: int | None = None  # lm-eval's tasks' settings
    num_fewshot: int | None = None
    apply_chat_template: bool = True

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


def read_shape_spec(text: str, base_dir: Path | None = None, allow_benchmarks: bool = False) -> ShapeSpec:
    """The structure search in YAML ``text`` (paths relative to ``base_dir``; benchmark task names refused unless
    ``allow_benchmarks``, as the parameter genome's); :class:`ConfigError` for the first problem, naming its YAML
    path."""
    doc: dict[str, Any] = parse_documents(text, source="CONFIG")[0]
    _known(doc, _TOP, "")
    if "tasks" not in doc:
        raise ConfigError("CONFIG has no tasks", yaml_path="tasks", hint="nll, kl or lm-eval tasks score a structure")
    genome = _genome(doc["genome"], base_dir)
    tasks = _tasks(doc["tasks"], base_dir, allow_benchmarks)
    held = _tasks(doc["held_out"], base_dir, allow_benchmarks) if "held_out" in doc else ()
    return ShapeSpec(genome, tasks, held, text, limit=_count(doc.get("limit"), "limit"),
                     num_fewshot=_count(doc.get("num_fewshot"), "num_fewshot"),
                     apply_chat_template=_flag(doc.get("apply_chat_template", True), "apply_chat_template"))


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
    sources = value.get("sources", [])
    if not isinstance(sources, list):
        raise ConfigError("must be a list of models of the base's family", yaml_path="genome.sources")
    found = tuple(_path(p, f"genome.sources[{i}]", base_dir) for i, p in enumerate(sources))
    scales = value.get("scales", [1.0])
    if not (isinstance(scales, list) and scales and all(_number(v) and 0 <= v <= 10 for v in scales)
            and len(set(scales)) == len(scales)):
        raise ConfigError("must be a list of distinct multipliers, 0 to 10", yaml_path="genome.scales")
    swap = value.get("swap", 0)
    if not _whole(swap) or swap < 0:
        raise ConfigError("must be a whole number of 0 or more: the longest block swapped", yaml_path="genome.swap")
    if swap and not found and scales == [1.0]:
        raise ConfigError("swaps a block for another source's or a scaled one: name sources or scales",
                          yaml_path="genome.swap")
    return StructureGenome(model, grow, shrink, repeat, pattern, beam_width=beam[0], beam_depth=beam[1],
                           beam_edits=beam[2], surrogate=surrogate, sources=found,
                           scales=tuple(float(v) for v in scales), swap=swap,
                           scale_search=_scale_search(value.get("scale_search")))


def _scale_search(value: Any) -> ScaleSearch | None:
    if value is None:
        return None
    _known(value, ("evaluations", "sigma0", "bounds"), "genome.scale_search.")
    plain = ScaleSearch()
    evaluations, sigma0 = value.get("evaluations", plain.evaluations), value.get("sigma0", plain.sigma0)
    if not _whole(evaluations) or evaluations < 2:
        raise ConfigError("must be a whole number of 2 or more", yaml_path="genome.scale_search.evaluations")
    if not _number(sigma0) or sigma0 <= 0:
        raise ConfigError("must be a positive number", yaml_path="genome.scale_search.sigma0")
    bounds = value.get("bounds", list(plain.bounds))
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(_number(v) for v in bounds)
            and 0 <= bounds[0] < bounds[1] <= 10):
        raise ConfigError("must be [low, high], 0 ≤ low < high ≤ 10", yaml_path="genome.scale_search.bounds")
    return ScaleSearch(evaluations, float(sigma0), (float(bounds[0]), float(bounds[1])))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        """The candidate in words (``base``; ``repeat 8-11``: layers 8 to 11 run twice; ``skip 3-4``; ``swap 3-4
        from 1 ×0.5``: layers 3-4 of source 1, their output projections halved)."""
        return ", ".join(e.key for e in self.edits) or "base"

    def path(self, layers: int) -> list[Layer]:
        """The decoder layers the candidate runs, in order."""
        found: list[Layer] = []
        cursor = 0
        for e in self.edits:
            if e.kind == REPEAT:
                found += [*range(cursor, e.after), *(e.copy(k) for k in range(e.first, e.after))]
            elif e.kind == SWAP:
                found += [*range(cursor, e.first), *(e.copy(k) for k in range(e.first, e.after))]
            else:
                found += range(cursor, e.first)
            cursor = e.after
        return found + list(range(cursor, layers))

    def with_edit(self, edit: Edit) -> Shape | None:
        """This candidate with ``edit`` too (None where it overlaps one of its edits)."""
        if any(edit.first < e.after and e.first < edit.after for e in self.edits):
            return None
        return Shape(tuple(sorted((*self.edits, edit), key=lambda e: (e.first, e.after, e.kind, e.source,
                                                                      e.scale))))

    def scaled(self, scales: Sequence[float]) -> Shape:
        """This candidate with its repeated and swapped blocks' scales (in order) replaced by ``scales``."""
        it = iter(scales)
        return Shape(tuple(e._replace(scale=next(it)) if e.kind != SKIP else e for e in self.edits))

    def to_json(self) -> list[list[Any]]:
        return [list(e[:3]) if (e.source, e.scale) == (0, 1) else list(e) for e in self.edits]

    @classmethod
    def from_json(cls, doc: Sequence[Sequence[Any]]) -> Shape:
        return cls(tuple(Edit(str(e[0]), int(e[1]), int(e[2]), *((int(e[3]), float(e[4])) if len(e) > 3 else ()))
                         for e in doc))


def blocks(path: Sequence[Layer]) -> list[tuple[int, int, int, float]]:
    """``path`` as its runs of consecutive layers of one source at one scale, each ``(first, after last, source,
    scale)``: the slices."""
    found: list[tuple[int, int, int, float]] = []
    for entry in path:
        source, scale = (0, 1.0) if isinstance(entry, int) else (entry.source, entry.scale)
        layer = layer_of(entry)
        if found and found[-1][1:] == (layer, source, scale):
            found[-1] = (found[-1][0], layer + 1, source, scale)
        else:
            found.append((layer, layer + 1, source, scale))
    return found


def shape_config(model: str, path: Sequence[Layer], sources: Sequence[str] = ()) -> dict[str, Any]:
    """The merge config that writes the candidate of layer ``path``: a passthrough of its sources' layer ranges
    (``run`` gives each output layer its source layer's per-layer facts: :mod:`resumerge.merge.plan.outconfig`), a
    scaled block's source carrying mergekit's ``scale`` parameter on its output projections."""
    models = [model, *sources]
    slices = []
    for a, b, source, scale in blocks(path):
        each: dict[str, Any] = {"model": models[source], "layer_range": [a, b]}
        if scale != 1:
            each["parameters"] = {"scale": scale_parameter(scale)}
        slices.append({"sources": [each]})
    return {"merge_method": "passthrough", "slices": slices}


def single_edits(genome: StructureGenome, layers: int) -> list[Edit]:
    """Every single edit the genome allows on a base of ``layers`` layers, in order: each block ``i..j−1`` inside
    ``repeat`` repeated (within ``grow``; its copy from each source at each scale), skipped (within ``shrink``) and
    swapped for each other source's at each scale, or the base's scaled (within ``swap``)."""
    first, last = genome.repeat if genome.repeat is not None else (0, layers - 1)
    last = min(last, layers - 1)
    most_added, most_dropped = int(layers * genome.grow / 100), int(layers * genome.shrink / 100)
    choices = [(s, c) for s in range(len(genome.sources) + 1) for c in genome.scales]
    found: list[Edit] = []
    for a in range(first, last + 1):
        for b in range(a + 1, last + 2):
            if b - a <= most_added:
                found += (Edit(REPEAT, a, b, s, c) for s, c in choices)
            if b - a <= most_dropped and b - a < layers:
                found.append(Edit(SKIP, a, b))
            if b - a <= genome.swap:
                found += (Edit(SWAP, a, b, s, c) for s, c in choices if (s, c) != (0, 1))
    return found


def within(genome: StructureGenome, shape: Shape, layers: int) -> bool:
    """Whether ``shape``'s size is within the genome's bounds, its path beginning and ending with the base's
    layers (``run`` takes the embeddings, the final norm and the head from the first and last slices' models)."""
    path = shape.path(layers)
    size = len(path)
    ends = [e for e in (path[0], path[-1]) if not isinstance(e, int) and e.source != 0] if path else []
    return not ends and layers - int(layers * genome.shrink / 100) <= size <= layers + int(layers * genome.grow / 100)


def period(types: Sequence[str]) -> int:
    """The shortest period of the per-layer ``types`` (their length where they repeat no shorter pattern)."""
    n = len(types)
    return next(p for p in range(1, n + 1) if all(types[k] == types[k % p] for k in range(n)))


def keeps_pattern(types: Sequence[str] | None, path: Sequence[Layer]) -> bool:
    """Whether the layer path's types follow the base's periodic pattern (``types``: the base's per layer; None: one
    kind of layer, every path does)."""
    if not types:
        return True
    p = period(types)
    return all(types[layer_of(entry)] == types[k % p] for k, entry in enumerate(path))


def layer_types(config: Mapping[str, Any]) -> list[str] | None:
    """The base's ``layer_types`` as its config.json lists them (its text config's, for a wrapper config)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = text.get("layer_types") if isinstance(text, dict) else None
    return [str(t) for t in found] if isinstance(found, list) else None
