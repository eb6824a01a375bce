"""A structure search from start to end: the base, then every single edit the genome allows (the scan), then a beam over
compositions (each round, the ``beam_width`` best candidates of the last round each given one more of the ``beam_edits``
best single edits that overlaps none of theirs), then (``scale_search``) CMA-ES over the scales of each member of that
front, then the held-out tasks of every candidate on the size/score Pareto front. Which candidates come next depends
only on the figures recorded so far, and each candidate's figures are recorded durably (``shapes.json``: temp, fsync,
rename) before the next starts, so a search killed at any instant, run again, scores the rest and writes the same files:
``evaluations.jsonl`` (a row per candidate: its edits, layer path, size, figures, objective, the layers its pass ran and
a full pass's), ``front.json`` (the Pareto front, with held-out figures) and ``best.yml`` (the lowest objective's merge
config)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resumerge.config.locations import StateDir
from resumerge.errors import ConfigError
from resumerge.forward.opening.opened import layer_of, open_for_pass
from resumerge.machine.durable import write_file_atomic
from resumerge.machine.killpoints import reach
from resumerge.runs.evolve import storage
from resumerge.runs.evolve.layercache import SCALED, Layer, branch
from resumerge.runs.evolve.objective import objective
from resumerge.runs.evolve.shapes.genome import (
    SKIP,
    Shape,
    ShapeSpec,
    keeps_pattern,
    layer_types,
    read_shape_spec,
    shape_config,
    single_edits,
    within,
)
from resumerge.runs.evolve.shapes.surrogate import rank_correlation, ranked, require
from resumerge.runs.evolve.spec import Task

MEASURED = "shapes.json"  # every candidate's figures, in the order scored: what the search resumes from
FRONT = "front.json"
SCALES = "scales"  # the phase of the candidates CMA-ES over the front's scales scores
SURROGATE = "surrogate.json"  # the surrogate's rank correlation on scored candidates it was not trained on


class Scores(Protocol):
    """Scores a layer path on tasks: its figure per task and the layers its pass ran (``prefix_layers``: those
    its beam parents' shared prefixes ran, beside them)."""

    prefix_layers: int

    def score(self, path: Sequence[Layer], tasks: Sequence[Task], parent: Sequence[Layer] | None = None
              ) -> tuple[dict[str, float], int]: ...


@dataclass(frozen=True)
class ShapePlan:
    """A structure search decided: its spec, the base's ``layers`` and per-layer ``types`` (None: one kind)."""

    spec: ShapeSpec
    layers: int
    types: tuple[str, ...] | None = None

    def identity(self) -> dict[str, Any]:
        """What makes two searches the same one (STORAGE holds one)."""
        return {"kind": "structure", "config": self.spec.fingerprint, "layers": self.layers}

    def allowed(self, shape: Shape) -> bool:
        """Whether ``shape`` is within the size bounds and (``pattern: keep``) follows the base's layer pattern."""
        genome = self.spec.genome
        return within(genome, shape, self.layers) and (
            genome.pattern != "keep" or keeps_pattern(self.types, shape.path(self.layers)))

    def scan(self) -> list[Shape]:
        """The base, then every allowed single edit."""
        singles = [Shape((e,)) for e in single_edits(self.spec.genome, self.layers)]
        return [Shape(), *(s for s in singles if self.allowed(s))]

    def config(self, shape: Shape) -> dict[str, Any]:
        return shape_config(self.spec.genome.model, shape.path(self.layers), self.spec.genome.sources)


@dataclass(frozen=True)
class Measured:
    """A scored candidate: its number (from 1, in the order scored), ``phase`` (``scan``, ``beam N``), shape, task
    figures, the layers its pass ran (``computed``) and its held-out figures (None: not asked)."""

    number: int
    phase: str
    shape: Shape
    tasks: dict[str, float | None]
    computed: int
    held_out: dict[str, float | None] | None = None
    parent: str | None = None  # the beam member it adds an edit to, whose prefix it ran from

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "phase": self.phase, "edits": self.shape.to_json(), "tasks": self.tasks,
                "computed": self.computed, "held_out": self.held_out, "parent": self.parent}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Measured:
        return cls(int(doc["number"]), str(doc["phase"]), Shape.from_json(doc["edits"]), dict(doc["tasks"]),
                   int(doc["computed"]), doc.get("held_out"), doc.get("parent"))


def plan_shapes(text: str, state: StateDir, allow_benchmarks: bool = False) -> ShapePlan:
    """The structure search the evolve config ``text`` asks for, judged from its YAML and the base's config.json
    (headers only): a ``repeat`` range past the base's layers, or a genome that allows no edit, refused naming the
    YAML path."""
    spec = read_shape_spec(text, allow_benchmarks=allow_benchmarks)
    config = open_for_pass(spec.genome.model, "genome.model", state).opened.config
    inner = config.get("text_config")
    layers = (inner if isinstance(inner, dict) else config).get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"{spec.genome.model}'s config.json gives no num_hidden_layers", yaml_path="genome.model")
    repeat = spec.genome.repeat
    if repeat is not None and repeat[1] >= layers:
        raise ConfigError(f"layer {repeat[1]} is past the base's last, {layers - 1}", yaml_path="genome.repeat")
    if spec.genome.surrogate is not None:
        require()
    _refuse_unlike(spec, state)
    types = layer_types(config)
    plan = ShapePlan(spec, layers, tuple(types) if types else None)
    if len(plan.scan()) < 2:
        raise ConfigError("the genome allows no edit of the base's layers", yaml_path="genome",
                          hint="raise grow (or shrink), or widen repeat")
    return plan


def _refuse_unlike(spec: ShapeSpec, state: StateDir) -> None:
    """A source whose layers are not the base's (the same names, shapes and layer types), or scales on a family
    without the output projections they multiply, refused naming the YAML path (headers only)."""
    genome = spec.genome
    base = open_for_pass(genome.model, "genome.model", state).opened
    layered = {n: t.entry.shape for n, t in base.tensors.items() if layer_of(n) is not None}
    if any(c != 1 for c in genome.scales) and not any(p in n for n in layered for p in SCALED):
        raise ConfigError(f"the base's layers have none of the output projections a scale multiplies "
                          f"({', '.join(SCALED)})", yaml_path="genome.scales")
    for i, source in enumerate(genome.sources):
        opened = open_for_pass(source, f"genome.sources[{i}]", state).opened
        theirs = {n: t.entry.shape for n, t in opened.tensors.items() if layer_of(n) is not None}
        unlike = next((n for n in sorted(layered) if theirs.get(n) != layered[n]), None)
        if unlike is None and layer_types(opened.config) != layer_types(base.config):
            unlike = "layer_types"
        if unlike is not None:
            raise ConfigError(f"{source} is not of the base's family: its {unlike} is not the base's",
                              yaml_path=f"genome.sources[{i}]", hint="a source has the base's layers and shapes")


def figure_of(tasks: Sequence[Task], figures: Mapping[str, float | None]) -> float:
    """The objective of recorded figures (None: not finite)."""
    return objective(tasks, {k: math.nan if v is None else v for k, v in figures.items()})


class ShapeSearch:
    """The search ``plan`` in ``store`` (claimed), its candidates scored by ``scorer``; ``say`` is told where it is."""

    def __init__(self, plan: ShapePlan, store: Path, scorer: Scores, say: storage.Say) -> None:
        self.plan, self.store, self.scorer, self.say = plan, store, scorer, say
        self.measured = read_measured(store)

    def run(self) -> Measured:
        """Score every candidate (those recorded before are not scored again), then write the files; the best."""
        plan, genome = self.plan, self.plan.spec.genome
        for shape in plan.scan():
            self._measure(shape, "scan")
        edits = [m.shape.edits[0] for m in self._ranked(1)][:genome.beam_edits]
        for depth in range(1, genome.beam_depth + 1):
            parents = self._ranked(depth)[:genome.beam_width]
            children: dict[str, Shape] = {}
            made_by: dict[str, int] = {}  # each child's parent (the first that makes it), by its rank
            for rank, parent in enumerate(parents):
                for edit in edits:
                    child = parent.shape.with_edit(edit)
                    if child is not None and plan.allowed(child) and child.key not in children:
                        children[child.key], made_by[child.key] = child, rank
            chosen = sorted(children)
            if genome.surrogate is not None:  # trained on the rounds before: a resumed round chooses the same
                earlier = [(m.shape, self._order(m)[0]) for m in self._numbered() if len(m.shape.edits) <= depth]
                best = ranked(earlier, [children[k] for k in chosen], plan.layers)[:genome.surrogate]
                chosen = sorted(s.key for s in best)
            # a parent's children one after another, in the order they branch off its path: its prefix runs once
            paths = {rank: parent.shape.path(plan.layers) for rank, parent in enumerate(parents)}
            for key in sorted(chosen, key=lambda k: (made_by[k], branch(children[k].path(plan.layers),
                                                                         paths[made_by[k]]), k)):
                self._measure(children[key], f"beam {depth}", parents[made_by[key]].shape)
        if genome.scale_search is not None:  # the front of the scan and the beam: the same after any kill
            for member in front(plan, [m for m in self.measured.values() if m.phase != SCALES]):
                self._scales(member)
        if plan.spec.held_out:
            for each in front(plan, list(self.measured.values())):
                self._held_out(each)
        if genome.surrogate is not None:
            found = rank_correlation([(m.shape, self._order(m)[0]) for m in self._numbered()], plan.layers)
            write_file_atomic(self.store / SURROGATE, json.dumps(found, indent=1).encode())
        write_outputs(self.store, plan, list(self.measured.values()))
        return best_of(plan, list(self.measured.values()))

    def _scales(self, member: Measured) -> None:
        """CMA-ES (:class:`~resumerge.runs.evolve.strategy.Search`, seed 0) over the scales of ``member``'s
        repeated and swapped blocks, from the scales it has: each genotype clipped to the bounds and rounded to four
        decimals is a candidate (``phase`` ``scales``), scored once (a resumed search replays the strategy from the
        recorded figures: the same genotypes, the same candidates)."""
        from resumerge.runs.evolve.strategy import Search, Settings

        asked = self.plan.spec.genome.scale_search
        x0 = tuple(e.scale for e in member.shape.edits if e.kind != SKIP)
        if asked is None or not x0:
            return
        low, high = asked.bounds
        strategy = Search(Settings(x0, asked.sigma0, None, 0, asked.evaluations))
        while not strategy.done():
            figures = []
            for genotype in strategy.ask():
                shape = member.shape.scaled([round(min(max(v, low), high), 4) for v in genotype])
                self._measure(shape, SCALES)  # its size and ends are the member's: allowed as it is
                figures.append(self._order(self.measured[shape.key])[0])
            strategy.tell(figures)

    def _numbered(self) -> list[Measured]:
        return sorted(self.measured.values(), key=lambda m: m.number)

    def _ranked(self, edits: int) -> list[Measured]:
        """The candidates of ``edits`` edits, best first (ties: fewer layers, then by name)."""
        return sorted((m for m in self.measured.values() if len(m.shape.edits) == edits), key=self._order)

    def _order(self, m: Measured) -> tuple[float, int, str]:
        return figure_of(self.plan.spec.tasks, m.tasks), len(m.shape.path(self.plan.layers)), m.shape.key

    def _measure(self, shape: Shape, phase: str, parent: Shape | None = None) -> None:
        if shape.key in self.measured:
            return
        number = len(self.measured) + 1
        self.say(phase=f"{phase}: {shape.key}", candidates=[number], layer=None, layers=None)
        figures, computed = self.scorer.score(shape.path(self.plan.layers), self.plan.spec.tasks,
                                              None if parent is None else parent.path(self.plan.layers))
        self._record(Measured(number, phase, shape, _finite(figures), computed,
                              parent=None if parent is None else parent.key))
        self.say(prefix_layers=self.scorer.prefix_layers)

    def _held_out(self, m: Measured) -> None:
        if m.held_out is not None:
            return
        self.say(phase=f"held out: {m.shape.key}", candidates=[m.number], layer=None, layers=None)
        figures, _ = self.scorer.score(m.shape.path(self.plan.layers), self.plan.spec.held_out)
        self._record(Measured(m.number, m.phase, m.shape, m.tasks, m.computed, _finite(figures), m.parent))

    def _record(self, m: Measured) -> None:
        self.measured[m.shape.key] = m
        # each with its size and objective: status shows the front so far from this file alone
        doc = [{**each.to_json(), "shape": each.shape.key, "layers": len(each.shape.path(self.plan.layers)),
                "objective": self._order(each)[0]} for each in self.measured.values()]
        write_file_atomic(self.store / MEASURED, json.dumps(doc, indent=1).encode())
        best = best_of(self.plan, list(self.measured.values()))
        self.say(evaluated=len(self.measured), best=figure_of(self.plan.spec.tasks, best.tasks))
        reach("after_evolve_candidate")  # tests kill the search here: a candidate recorded, the next not begun


def _finite(figures: Mapping[str, float]) -> dict[str, float | None]:
    return {k: v if math.isfinite(v) else None for k, v in figures.items()}


def read_measured(store: Path) -> dict[str, Measured]:
    """Every candidate recorded in ``store``, by name, in the order scored."""
    path = store / MEASURED
    if not path.is_file():
        return {}
    found = [Measured.from_json(doc) for doc in json.loads(path.read_text(encoding="utf-8"))]
    return {m.shape.key: m for m in found}


def best_of(plan: ShapePlan, measured: Sequence[Measured]) -> Measured:
    """The lowest objective (ties: fewer layers, then by name)."""
    return min(measured, key=lambda m: (figure_of(plan.spec.tasks, m.tasks), len(m.shape.path(plan.layers)),
                                        m.shape.key))


def front(plan: ShapePlan, measured: Sequence[Measured]) -> list[Measured]:
    """The size/score Pareto front: every candidate no other beats on both its layer count and its objective (no
    worse on both, better on one), by size."""
    scored = sorted(((len(m.shape.path(plan.layers)), figure_of(plan.spec.tasks, m.tasks), m.shape.key, m)
                     for m in measured), key=lambda t: (t[0], t[1], t[2]))
    found: list[Measured] = []
    lowest = math.inf
    for _, value, _, m in scored:
        if value < lowest:
            found.append(m)
            lowest = value
    return found


def row(plan: ShapePlan, m: Measured) -> dict[str, Any]:
    """A candidate as ``evaluations.jsonl`` holds it."""
    path = m.shape.path(plan.layers)
    return {"candidate": m.number, "phase": m.phase, "shape": m.shape.key, "edits": m.shape.to_json(),
            "layers": len(path), "path": path, "objective": figure_of(plan.spec.tasks, m.tasks), "tasks": m.tasks,
            "computed": m.computed, "full": len(path), "parent": m.parent, "config": plan.config(m.shape)}


def write_outputs(store: Path, plan: ShapePlan, measured: Sequence[Measured]) -> None:
    """The table, the front and ``best.yml`` from what is recorded (the same bytes whenever)."""
    import yaml

    ordered = sorted(measured, key=lambda m: m.number)
    write_file_atomic(store / storage.TABLE, "".join(json.dumps(row(plan, m)) + "\n" for m in ordered).encode())
    held = plan.spec.held_out
    doc = [{"shape": m.shape.key, "layers": len(m.shape.path(plan.layers)),
            "objective": figure_of(plan.spec.tasks, m.tasks), "tasks": m.tasks, "held_out": m.held_out,
            "held_out_objective": figure_of(held, m.held_out) if held and m.held_out is not None else None}
           for m in front(plan, ordered)]
    write_file_atomic(store / FRONT, json.dumps(doc, indent=1).encode())
    best = best_of(plan, ordered)
    head = (f"# resumerge evolve (structure): the best of {len(ordered)} candidates ({best.shape.key}, "
            f"{len(best.shape.path(plan.layers))} layers), objective {figure_of(plan.spec.tasks, best.tasks)!r}\n")
    text = head + yaml.safe_dump(plan.config(best.shape), sort_keys=False)
    write_file_atomic(store / storage.BEST, text.encode(), point="during_best_write")
