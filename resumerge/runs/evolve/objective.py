"""What scores a generation, and how a candidate's task figures become the one objective the optimiser minimises.

:class:`ScoresGeneration` is the one protocol: candidate merge configs in, each candidate's figure per task out.
Its first implementation (:mod:`.written`) merges each candidate with ``run``'s code and scores it on the forward
engine; a streamed one (every candidate's layer merged in memory in one pass over the parents) takes its place
without the search knowing which it has. The weighting is mergekit-evolve's: a task's figure times its weight,
summed, a figure to maximise (an lm-eval ``acc``) counting up and a KL or NLL counting down; the optimiser
minimises the negative of that score."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from resumerge.runs.evolve.spec import Task

# The objective of a candidate whose figures are not finite (a merge gone to NaN): worse than any finite one, yet
# a number cma can rank.
BROKEN = 1e30


class ScoresGeneration(Protocol):
    """Scores the candidates of one generation: ``score(generation, configs, done, record)`` returns, per
    candidate, its figure per task name. ``done(index)`` gives a candidate's figures recorded before (a resumed
    generation: not scored again); ``record(index, figures)`` is called as each candidate is scored, so that a
    killed generation keeps what it finished."""

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]: ...


def one_by_one(configs: Sequence[Mapping[str, Any]], done: Callable[[int], dict[str, float] | None],
               record: Callable[[int, dict[str, float]], None],
               scored: Callable[[int, Mapping[str, Any]], dict[str, float]]) -> list[dict[str, float]]:
    """:meth:`ScoresGeneration.score` for a scorer that takes the candidates one at a time: each candidate's figures
    ``scored(index, config)`` unless ``done`` has them already, recorded as each is scored."""
    found: list[dict[str, float]] = []
    for index, config in enumerate(configs):
        figures = done(index)
        if figures is None:
            figures = scored(index, config)
            record(index, figures)
        found.append(figures)
    return found


def objective(tasks: Sequence[Task], figures: Mapping[str, float]) -> float:
    """The number the optimiser minimises: −Σ weight × figure over tasks a larger figure is better for, +Σ weight ×
    figure over those a smaller one is (KL, NLL); :data:`BROKEN` where a figure is not finite."""
    total = 0.0
    for task in tasks:
        value = figures[task.name]
        if not math.isfinite(value):
            return BROKEN
        total += task.weight * value if task.lowers else -task.weight * value
    return total
