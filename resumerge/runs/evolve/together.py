"""A generation scored by several scorers, each for its own tasks (the streamed kl/nll pass, lm-eval's tasks): a
candidate's figures are all of theirs. Each scorer's figures are journaled under its own part of the candidate's
journal, so a killed generation resumes every scorer where it stopped."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from resumerge.runs.evolve import storage
from resumerge.runs.evolve.objective import ScoresGeneration


class Together:
    """Scores with every scorer of ``parts`` (its name, the scorer) in turn."""

    def __init__(self, store: Path, parts: Sequence[tuple[str, ScoresGeneration]]) -> None:
        self.store, self.parts = store, tuple(parts)

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]:
        found = {i: done(i) for i in range(len(configs))}
        pending = [i for i, figures in found.items() if figures is None]
        merged: dict[int, dict[str, float]] = {i: {} for i in pending}
        for name, scorer in self.parts:
            def part_done(k: int, name: str = name) -> dict[str, float] | None:
                return storage.journaled(self.store, generation, pending[k], part=name)

            def part_record(k: int, figures: dict[str, float], name: str = name) -> None:
                storage.journal(self.store, generation, pending[k], figures, part=name)

            for k, figures in enumerate(scorer.score(generation, [configs[i] for i in pending], part_done,
                                                     part_record)):
                merged[pending[k]].update(figures)
        for i in pending:
            record(i, merged[i])
            found[i] = merged[i]
        return [f for _, f in sorted(found.items()) if f is not None]
