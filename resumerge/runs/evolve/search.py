"""A search from start to end: its settings decided and STORAGE claimed, the optimiser restored from what STORAGE
holds, then generation after generation asked, scored (a candidate journaled as it is scored) and told, each
generation's state made durable before the user's files are written from it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.runs.evolve import storage
from resumerge.runs.evolve.genome import Layout, initial_genotype, layout_of, merge_config, random_genotype
from resumerge.runs.evolve.objective import ScoresGeneration, objective
from resumerge.runs.evolve.options import SearchOptions
from resumerge.runs.evolve.progress import SearchProgress
from resumerge.runs.evolve.spec import EvolveSpec
from resumerge.runs.evolve.storage import Evaluated
from resumerge.runs.evolve.strategy import Search, Settings, default_popsize
from resumerge.runs.evolve.tracking import SearchLog


@dataclass(frozen=True)
class Planned:
    """A search decided: the genotype's layout, the layers of the models and the strategy's settings."""

    spec: EvolveSpec
    layout: Layout
    layers: int
    settings: Settings

    @property
    def popsize(self) -> int:
        return self.settings.popsize or default_popsize(self.layout.size)

    def identity(self) -> dict[str, Any]:
        """What makes two searches the same one (STORAGE holds one): the config, the settings, the shape."""
        return {"config": self.spec.fingerprint, "settings": self.settings.to_json(), "size": self.layout.size,
                "layers": self.layers}

    def config_of(self, genotype: Sequence[float]) -> dict[str, Any]:
        """The merge config ``genotype`` becomes."""
        return merge_config(self.spec.genome, self.layout, self.layers, genotype)


def plan_search(spec: EvolveSpec, layers: int, options: SearchOptions) -> Planned:
    """The search ``spec`` asks for, over models of ``layers`` decoder layers (see :func:`.genome.layout_of`),
    starting from mergekit-evolve's first genotype (the method's default-parameter merge), or with the config's
    ``random_init`` from a random one of the seed."""
    layout = layout_of(spec.genome, layers)
    start = random_genotype(layout, options.random_seed) if spec.random_init else initial_genotype(layout)
    settings = Settings(tuple(start), options.sigma0, options.popsize, options.random_seed,
                        options.max_fevals)
    return Planned(spec, layout, layers, settings)


def run_search(planned: Planned, store: Path, scorer: ScoresGeneration, progress: SearchProgress | None = None,
               command: str = "", logs: Sequence[SearchLog] = ()) -> Evaluated:
    """Run (or resume) the search ``planned`` in ``store`` (claimed already) and return its best candidate: exactly
    ``max_fevals`` candidates scored (fewer where cma's own criteria stop it first), the last generation cut to what
    is left. ``progress`` is told where it is (None: ``progress.json`` alone); ``command``: what continues it.
    ``logs``: told each generation once it is durable (and, first, what a killed search told)."""
    tasks = planned.spec.tasks
    names = [t.name for t in tasks]
    progress = progress or SearchProgress(store)
    storage.sweep(store)
    generations = storage.read_state(store)
    search = Search.restore(planned.settings, [([e.genotype for e in g], [e.objective for e in g])
                                               for g in generations])
    best = storage.best_of(generations)
    # the next generation's candidates a killed process journaled: scored already, in no time of this process
    kept = [objective(tasks, f) for f in map(done_in(store, len(generations) + 1), range(search.popsize))
            if f is not None] if not search.done() else []
    lowest = min([*kept, *([best.objective] if best is not None else [])], default=None)
    progress.start(popsize=search.popsize, max_fevals=planned.settings.max_fevals,
                   evaluated=search.evaluations + len(kept), best=lowest, command=command)
    if generations:  # a kill while they were written leaves them stale: the same bytes again
        storage.write_outputs(store, generations, names)
    for log in logs:
        log.told(generations)
    while not search.done():
        number = len(generations) + 1
        genotypes = search.ask()
        configs = [planned.config_of(x) for x in genotypes]
        done = done_in(store, number)
        progress.generation(number, len(genotypes))

        def record(index: int, figures: dict[str, float], number: int = number) -> None:
            storage.journal(store, number, index, figures)
            progress.scored(index, objective(tasks, figures))

        figures = scorer.score(number, configs, done, record)
        told = [Evaluated(number, i, genotypes[i], configs[i], objective(tasks, figures[i]),
                          {k: v if math.isfinite(v) else None for k, v in figures[i].items()})
                for i in range(len(genotypes))]
        search.tell([e.objective for e in told])
        generations.append(told)
        storage.write_state(store, generations, search.figures())
        storage.write_outputs(store, generations, names)
        for log in logs:
            log.told(generations)
    progress.finish(search.evaluations)
    best = storage.best_of(generations)
    assert best is not None  # cma asks at least one generation
    return best


def done_in(store: Path, generation: int) -> Callable[[int], dict[str, float] | None]:
    """The figures journaled for a candidate of ``generation`` (None: not scored yet)."""
    return lambda index: storage.journaled(store, generation, index)
