"""The first way to score a generation: each candidate merged whole by ``run``'s own code into a folder of its own
under STORAGE (a journaled run: killed, it resumes), scored task by task on the forward engine (:mod:`.scoring`),
its figures journaled, then its folder removed. Honest and slow: a candidate costs a merge written to disk and one
pass of each task's models; the streamed population (every candidate's layer merged in memory in one pass over the
parents) replaces it behind the same protocol (:class:`~resumerge.runs.evolve.objective.ScoresGeneration`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from resumerge.config.locations import StateDir
from resumerge.runs.evolve import storage
from resumerge.runs.evolve.objective import one_by_one
from resumerge.runs.evolve.scoring import task_figure
from resumerge.runs.evolve.spec import Task

# Writes merge config ``text`` into ``out`` as ``resumerge run`` does, its run's state under ``state_dir``, and
# gives back that state dir as it resolved it (handed in by the API: this package sits below it and resolves none).
Merge = Callable[[str, Path, Path], StateDir]


class WrittenCandidates:
    """Scores each candidate from its written merge (see the module's docstring), its passes' layers on
    ``device``; ``say``: told where it is (None: ``progress.json`` in ``store`` alone)."""

    def __init__(self, store: Path, tasks: Sequence[Task], merge: Merge, tokenizer: Path | None,
                 device: str = "cpu", say: storage.Say | None = None) -> None:
        self.store, self.merge, self.tokenizer, self.device = store, merge, tokenizer, device
        self.say: storage.Say = say or partial(storage.say, store)
        self.tasks = tuple(t for t in tasks if t.kind in ("kl", "nll"))

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]:
        def recorded(index: int, figures: dict[str, float]) -> None:
            record(index, figures)
            # ours: the merge and its run's state, removed once its figures are journaled
            shutil.rmtree(storage.work_dir(self.store, generation, index), ignore_errors=True)

        return one_by_one(configs, done, recorded, lambda index, config: self._scored(generation, index, config))

    def _scored(self, generation: int, index: int, config: Mapping[str, Any]) -> dict[str, float]:
        import yaml

        work = storage.work_dir(self.store, generation, index)
        out, state = work / "merge", work / "state"
        self.say(generation=generation, candidates=[index], phase="merge", layer=None, layers=None)
        resolved = self.merge(yaml.safe_dump(dict(config), sort_keys=False), out, state)
        figures: dict[str, float] = {}
        for number, task in enumerate(self.tasks):
            def on_layer(layer: int, layers: int, task: Task = task) -> None:
                self.say(phase=f"score {task.name}", layer=layer, layers=layers)

            figures[task.name] = task_figure(out, task, resolved, work / f"task-{number}",
                                             self.store / storage.TOKENS, self.tokenizer, on_layer, self.device)
        return figures
