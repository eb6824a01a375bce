"""Where a search in STORAGE stands, read from its files alone (fast: no torch, no model opened): running (its
process alive), interrupted (gone before the end: the command that continues it) or finished; the generation of
how many, the candidates and what they are doing (merging, or which task's pass at which layer), the best objective
so far and, while it runs, the time left the search itself estimates (:mod:`.progress`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from resumerge.errors import UsageError
from resumerge.machine.memory.sizes import format_duration
from resumerge.machine.runlock import pid_alive
from resumerge.machine.threadcount import recorded_threads, threads_words
from resumerge.runs.evolve import storage
from resumerge.runs.evolve.progress import generations_of


@dataclass(frozen=True)
class SearchStatus:
    """A search's state: ``state`` (``running``; ``interrupted``: its process, ``pid``, is gone before the end, and
    ``resume_command`` continues it; ``finished``), ``generation`` under way (or the last, once finished) of
    ``generations`` (max_fevals over popsize, the last generation cut to what is left), the ``candidates`` it scores
    (numbered from 1; a streamed pass: its group) of the generation's ``size`` and their ``phase`` (``merge``,
    ``score TASK``) at ``layer`` of ``layers``; ``evaluated`` candidates of ``max_fevals``, the ``best`` objective so
    far, ``seconds_left`` (the running search's estimate; None: not known yet, or not running) and ``threads``, the
    torch thread count every candidate is scored with, decided as the search first started (None: none recorded)."""

    storage: str
    state: str
    pid: int | None
    resume_command: str | None
    generation: int
    generations: int
    candidates: list[int]
    size: int
    popsize: int
    phase: str | None
    layer: int | None
    layers: int | None
    evaluated: int
    max_fevals: int
    best: float | None
    seconds_left: float | None
    threads: int | None = None
    front: tuple[str, ...] = ()  # a structure search's size/score Pareto front, a line a candidate
    stage: str | None = None  # a combined search's stage (parameters, the merge, structure): the rest is its own

    @property
    def finished(self) -> bool:
        return self.state == "finished"

    @property
    def candidate(self) -> int | None:
        """The first candidate the search scores (numbered from 1), None between candidates."""
        return self.candidates[0] if self.candidates else None

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "front": list(self.front), "finished": self.finished}

    def lines(self) -> list[str]:
        """The status in words, a line each."""
        if self.stage is not None:
            return [f"combined search in {self.storage}: {self.state}, stage {self.stage}",
                    *replace(self, stage=None).lines()[1:]]
        if self.front:
            return [f"structure search in {self.storage}: {self.state}, {self.evaluated} candidates scored"
                    + (f" (pid {self.pid})" if self.state == "running" and self.pid is not None else ""),
                    *([f"now: {self.phase}" + (f", layer {self.layer + 1} of {self.layers}"
                                               if self.layer is not None and self.layers else "")]
                      if self.phase and not self.finished else []),
                    "the size/score front (layers, objective, held-out):", *self.front,
                    *([f"to continue: {self.resume_command}"] if self.resume_command is not None else [])]
        if self.finished:
            return [f"search in {self.storage}: finished, {self.evaluated} candidates in {self.generation} "
                    "generations", self._best()]
        found = [f"search in {self.storage}: {self.state}, generation {self.generation} of {self.generations}"
                 + (f" (pid {self.pid})" if self.state == "running" and self.pid is not None else "")]
        if self.candidates:
            doing = f", {self.phase}" if self.phase else ""
            at = f", layer {self.layer + 1} of {self.layers}" if self.layer is not None and self.layers else ""
            found.append(f"{numbered(self.candidates)} of {self.size}{doing}{at}")
        found.append(self._best())
        if self.threads is not None:
            found.append(f"scored with {threads_words(self.threads)}")
        if self.state == "running":
            found.append("time left: " + ("unknown (nothing scored yet by this process)" if self.seconds_left is None
                                          else f"about {format_duration(self.seconds_left)}"))
        elif self.resume_command is not None:
            found.append(f"to continue: {self.resume_command}")
        return found

    def _best(self) -> str:
        return ("best objective so far: " + ("none yet" if self.best is None else f"{self.best:.6g}")
                + f" ({self.evaluated} of {self.max_fevals} candidates evaluated; see best.yml)")


def numbered(candidates: list[int]) -> str:
    """``candidate 3``, ``candidates 1-4`` (a run), ``candidates 1, 3``."""
    if len(candidates) == 1:
        return f"candidate {candidates[0]}"
    if candidates == list(range(candidates[0], candidates[0] + len(candidates))):
        return f"candidates {candidates[0]}-{candidates[-1]}"
    return "candidates " + ", ".join(map(str, candidates))


def search_status(store: Path) -> SearchStatus:
    """The status of the search in ``store``; raises :class:`UsageError` where ``store`` holds none."""
    if not storage.is_storage(store):
        raise UsageError(f"{store} holds no resumerge evolve search", hint="give the STORAGE of resumerge evolve")
    identity = json.loads((store / storage.SEARCH).read_text(encoding="utf-8"))
    if identity.get("kind") == "structure":
        return _structure_status(store)
    if identity.get("kind") == "combined":
        return _combined_status(store)
    generations = storage.read_state(store)
    seen = storage.progress(store)
    popsize = int(seen.get("popsize") or identity["settings"].get("popsize") or 1)
    max_fevals = int(identity["settings"]["max_fevals"])
    told = sum(len(g) for g in generations)
    finished = bool(seen.get("finished"))
    pid = seen.get("pid") if isinstance(seen.get("pid"), int) else None
    state = "finished" if finished else "running" if pid_alive(pid) else "interrupted"
    total = max(generations_of(max_fevals, popsize), len(generations))
    number = len(generations) if finished else len(generations) + 1
    under_way = not finished and seen.get("generation") == number
    size = int(seen.get("size") or 0) if under_way else min(popsize, max(max_fevals - told, 0))
    # the candidates of the generation under way journaled (a kill can come between a journal and its word)
    evaluated = told + sum(storage.journaled(store, number, i) is not None for i in range(size))
    command = seen.get("command") if state == "interrupted" and isinstance(seen.get("command"), str) else None
    best = storage.best_of(generations)
    lowest = seen.get("best") if under_way and isinstance(seen.get("best"), (int, float)) else None
    found = [v for v in (lowest, None if best is None else best.objective) if v is not None]
    return SearchStatus(str(store), state, pid, command, number, total,
                        list(seen.get("candidates") or []) if under_way else [],
                        size,
                        popsize, seen.get("phase") if under_way else None, seen.get("layer") if under_way else None,
                        seen.get("layers") if under_way else None, evaluated, max_fevals,
                        min(found) if found else None,
                        seen.get("seconds_left") if state == "running" else None,
                        recorded_threads(store, storage.THREADS))


def _structure_status(store: Path) -> SearchStatus:
    """A structure search's status: how many candidates are scored, what it does now, and its front so far (the
    front's file is written as the search ends; while it runs, the front of what ``shapes.json`` holds)."""
    seen = storage.progress(store)
    finished = bool(seen.get("finished"))
    pid = seen.get("pid") if isinstance(seen.get("pid"), int) else None
    state = "finished" if finished else "running" if pid_alive(pid) else "interrupted"
    command = seen.get("command") if state == "interrupted" and isinstance(seen.get("command"), str) else None
    measured = _json_list(store / "shapes.json")
    front = _json_list(store / "front.json") if finished else []
    if not front:  # while it runs: the front of what is scored so far
        lowest = float("inf")
        known = [m for m in measured if isinstance(m, dict) and {"layers", "objective", "shape"} <= set(m)]
        for m in sorted(known, key=lambda m: (m["layers"], m["objective"], m["shape"])):
            if m["objective"] < lowest:
                front.append(m)
                lowest = m["objective"]
    lines = tuple(f"  {f['shape']}: {f['layers']} layers, {f['objective']:.6g}"
                  + (f", held out {f['held_out_objective']:.6g}" if f.get("held_out_objective") is not None else "")
                  for f in front) or ("  (none scored yet)",)
    evaluated = len(measured)
    best = seen.get("best") if isinstance(seen.get("best"), (int, float)) else None
    layer, layers = seen.get("layer"), seen.get("layers")
    return SearchStatus(str(store), state, pid, command, 1, 1, [], 0, 0, seen.get("phase"),
                        layer if isinstance(layer, int) else None, layers if isinstance(layers, int) else None,
                        evaluated, evaluated, best, None, recorded_threads(store, storage.THREADS), lines)


def _combined_status(store: Path) -> SearchStatus:
    """A combined search's status: its stage (:mod:`.combined`), then the status of that stage's search; running,
    interrupted or finished and the command that continues it are the combined search's own."""
    from resumerge.runs.evolve.combined import PARAMETERS, STAGES, STRUCTURE, stage_of

    seen = storage.progress(store)
    stage = stage_of(store)
    inner = store / (STRUCTURE if stage == 2 else PARAMETERS)
    finished = bool(seen.get("finished"))
    pid = seen.get("pid") if isinstance(seen.get("pid"), int) else None
    state = "finished" if finished else "running" if pid_alive(pid) else "interrupted"
    command = seen.get("command") if state == "interrupted" and isinstance(seen.get("command"), str) else None
    if storage.is_storage(inner):
        return replace(search_status(inner), storage=str(store), state=state, pid=pid, resume_command=command,
                       stage=STAGES[stage])
    return SearchStatus(str(store), state, pid, command, 0, 0, [], 0, 0, None, None, None, 0, 0, None, None,
                        stage=STAGES[stage])


def _json_list(path: Path) -> list[dict[str, Any]]:
    """The list of records a structure search's file holds (empty where it is not there yet)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []
