"""Where a running search is, said as it moves: each word rewrites STORAGE's ``progress.json`` (what ``resumerge
status STORAGE`` reads, :mod:`.status`) and tells the watcher a :class:`SearchStep` (the CLI prints a line on stderr,
:mod:`resumerge.cli.evolveprogress`), as a check's :class:`~resumerge.analyses.check.progress.Progress` keeps its
file and tells its watcher.

The time left is estimated here, once, for both: the pace of this process's own work (candidates scored, and the
layers a candidate's pass has run, as a fraction of a candidate), so that a resumed search does not count what its
journal held as done in no time, times the evaluations left of ``max_fevals``. Candidates are numbered from 1 here
and everywhere a person reads them (STORAGE's journal keeps its own 0-based indexes)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.runs.evolve import storage


def generations_of(max_fevals: int, popsize: int) -> int:
    """The generations of a search of ``max_fevals`` evaluations, ``popsize`` a generation (the last one cut to
    what is left: :class:`~resumerge.runs.evolve.strategy.Search`); fewer where cma's own criteria stop it first."""
    return math.ceil(max_fevals / max(popsize, 1))


@dataclass(frozen=True)
class SearchStep:
    """One word of a search: ``event`` (``start``, ``generation``, ``phase``, ``layer``, ``scored``), the
    ``generation`` of ``generations``, the ``candidates`` it is about (numbered from 1; a streamed pass: its
    group) of the generation's ``size``, the ``phase`` and the decoder ``layer`` (0-based) of ``layers`` of a pass,
    the ``objective`` of a candidate just scored, ``evaluated`` of ``max_fevals``, the ``best`` objective so far,
    ``seconds_left`` (None: not known yet) and whether the search was ``resumed`` from STORAGE."""

    event: str
    generation: int
    generations: int
    candidates: tuple[int, ...]
    size: int
    phase: str | None
    layer: int | None
    layers: int | None
    objective: float | None
    evaluated: int
    max_fevals: int
    best: float | None
    seconds_left: float | None
    resumed: bool


# Told each step of a search (see :class:`SearchStep`).
Watcher = Callable[[SearchStep], None]


class SearchProgress:
    """The progress of the search in ``store``: ``progress.json`` and the ``watcher`` (None: the file alone).
    :meth:`say` is what a scorer is handed to say where its pass is (``generation``, ``candidates``, ``phase``,
    ``layer``, ``layers``); the search says the rest (:meth:`start`, :meth:`generation`, :meth:`scored`,
    :meth:`finish`)."""

    def __init__(self, store: Path, watcher: Watcher | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.watcher, self.clock = store, watcher, clock
        self.doc: dict[str, Any] = {}
        self._began: tuple[float, float] | None = None  # when this process began, and the work done then
        self._resumed = False

    def start(self, *, popsize: int, max_fevals: int, evaluated: int, best: float | None, command: str) -> None:
        """The search begins (or resumes with ``evaluated`` candidates scored, those a killed process journaled
        in the generation it was scoring among them, and the ``best`` objective of them): its process, the command
        that continues it, its size."""
        self._resumed = evaluated > 0
        self._began = (self.clock(), float(evaluated))
        self._write("start", pid=os.getpid(), command=command, popsize=popsize, max_fevals=max_fevals,
                    generations=generations_of(max_fevals, popsize), evaluated=evaluated, best=best,
                    finished=False, seconds_left=None, generation=None, size=None, candidates=[], phase=None,
                    layer=None, layers=None)

    def generation(self, number: int, size: int) -> None:
        """Generation ``number`` begins, ``size`` candidates."""
        generations = max(int(self.doc.get("generations") or 0), number)  # a search started before the cut
        self._write("generation", generation=number, size=size, generations=generations, candidates=[],
                    phase=None, layer=None, layers=None)

    def say(self, **where: Any) -> None:
        """Where a scorer's work is (``candidates``: the 0-based indexes it scores; ``phase``, ``layer``,
        ``layers``): the same words as :func:`.storage.say`, which a scorer says without a search's progress."""
        if "candidates" in where:
            where["candidates"] = [int(i) + 1 for i in where["candidates"]]
        where.pop("generation", None)  # the search's own count, said by :meth:`generation`
        event = "layer" if where.get("layer") is not None else "phase"
        self._write(event, **where)

    def scored(self, index: int, objective: float) -> None:
        """Candidate ``index`` (0-based) of the generation is scored, its ``objective``."""
        left = [c for c in self.doc.get("candidates") or [] if c != index + 1]
        best = self.doc.get("best")
        self._write("scored", _scored=(index + 1, objective), candidates=left,
                    evaluated=int(self.doc.get("evaluated") or 0) + 1,
                    best=objective if best is None else min(best, objective))

    def finish(self, evaluated: int) -> None:
        """The search has ended."""
        self._write("finished", finished=True, evaluated=evaluated, phase=None, layer=None, layers=None,
                    candidates=[], seconds_left=0.0)

    def _write(self, event: str, **changes: Any) -> None:
        scored = changes.pop("_scored", None)
        self.doc.update(changes)
        if event != "finished":
            self.doc["seconds_left"] = self._left()
        storage.say(self.store, **self.doc)
        if self.watcher is None:
            return
        d = self.doc
        numbers: Sequence[int] = (scored[0],) if scored is not None else d.get("candidates") or ()
        self.watcher(SearchStep(event, int(d.get("generation") or 0), int(d.get("generations") or 0),
                                tuple(numbers), int(d.get("size") or 0), d.get("phase"), d.get("layer"),
                                d.get("layers"), scored[1] if scored is not None else None, int(d["evaluated"]),
                                int(d["max_fevals"]), d.get("best"), d.get("seconds_left"), self._resumed))

    def _done(self) -> float:
        """The work done: the candidates scored, and the layers run of those in a pass (a fraction each)."""
        layer, layers = self.doc.get("layer"), self.doc.get("layers")
        running = len(self.doc.get("candidates") or ()) * layer / layers \
            if isinstance(layer, int) and isinstance(layers, int) and layers > 0 else 0.0
        return int(self.doc.get("evaluated") or 0) + running

    def _left(self) -> float | None:
        if self._began is None:
            return None
        began, before = self._began
        done, elapsed = self._done(), self.clock() - began
        if done <= before or elapsed <= 0:
            return None
        return elapsed / (done - before) * max(int(self.doc["max_fevals"]) - done, 0.0)
