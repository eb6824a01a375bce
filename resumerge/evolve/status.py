"""Where a search in STORAGE stands, read from its files alone (fast: no torch, no model opened): the generation
of about how many, the candidate and what it is doing (merging, or which task's pass at which layer), the best
objective so far and, from the candidates scored in this STORAGE, about how long the rest takes."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.errors import UsageError
from resumerge.evolve import storage


@dataclass(frozen=True)
class SearchStatus:
    """A search's state: ``generation`` under way (or the last, once ``finished``) of about ``generations``
    (max_fevals over popsize), the ``candidate`` of ``popsize`` and its ``phase`` (``merge``, ``score TASK``) at
    ``layer`` of ``layers``; ``evaluated`` candidates, the ``best`` objective so far, and ``seconds_left``
    (None: no candidate timed yet)."""

    storage: str
    generation: int
    generations: int
    candidate: int | None
    popsize: int
    phase: str | None
    layer: int | None
    layers: int | None
    evaluated: int
    best: float | None
    seconds_left: float | None
    finished: bool

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def lines(self) -> list[str]:
        """The status in words, a line each."""
        head = (f"search in {self.storage}: finished, {self.evaluated} candidates in {self.generation} generations"
                if self.finished else f"search in {self.storage}: generation {self.generation} of about "
                f"{self.generations}")
        found = [head]
        if not self.finished and self.candidate is not None:
            doing = f", {self.phase}" if self.phase else ""
            at = f", layer {self.layer + 1} of {self.layers}" if self.layer is not None and self.layers else ""
            found.append(f"candidate {self.candidate + 1} of {self.popsize}{doing}{at}")
        found.append("best objective so far: " + ("none yet" if self.best is None else f"{self.best:.6g}")
                     + f" ({self.evaluated} candidates evaluated; see best.yml)")
        if not self.finished:
            found.append("time left: " + ("unknown (no candidate scored yet)" if self.seconds_left is None
                                          else f"about {_duration(self.seconds_left)}"))
        return found


def search_status(store: Path) -> SearchStatus:
    """The status of the search in ``store``; raises :class:`UsageError` where ``store`` holds none."""
    if not storage.is_storage(store):
        raise UsageError(f"{store} holds no resumerge evolve search", hint="give the STORAGE of resumerge evolve")
    identity = json.loads((store / storage.SEARCH).read_text(encoding="utf-8"))
    generations = storage.read_state(store)
    seen = storage.progress(store)
    popsize = int(seen.get("popsize") or identity["settings"].get("popsize") or 1)
    max_fevals = int(identity["settings"]["max_fevals"])
    total = max(math.ceil(max_fevals / popsize), len(generations))
    evaluated = sum(len(g) for g in generations)
    best = storage.best_of(generations)
    finished = bool(seen.get("finished"))
    candidate = seen.get("candidate") if seen.get("generation") == len(generations) + 1 else None
    scored, seconds = int(seen.get("scored", 0)), float(seen.get("seconds", 0.0))
    done_now = candidate or 0
    left = max(total * popsize - evaluated - done_now, 0)
    return SearchStatus(str(store), len(generations) if finished else len(generations) + 1, total,
                        candidate, popsize, seen.get("phase"), seen.get("layer"), seen.get("layers"), evaluated,
                        None if best is None else best.objective,
                        seconds / scored * left if scored else None, finished)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
