"""The real-weights search of issue 68, shared by its test and ``bench/bench_evolve_real.py``.

SmolLM2-135M-Instruct and its two fine-tunes (``realmodel.smollm2_finetunes``: ``weather`` and ``recipes``); a
``task_arithmetic`` (or ``ties``) genome over the two with the base, ``layer_granularity`` splitting the 30 layers
into groups, scored by two ``kl`` tasks, each fine-tune on the first lines of its own training texts. The merges it
is held to: the method's default-parameter merge (mergekit-evolve's first genotype: every weight 1/2, every density
1; the search's first candidate) and the uniform linear merge, both in the candidates' dtype. Held-out figures are
each domain's held-out file scored by the same streamed pass the search scores its candidates with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from realmodel import DATA, DOMAINS

from resumerge import api
from resumerge.api.options import Resources
from resumerge.config.locations import StateDir
from resumerge.runs.evolve.genome import initial_genotype
from resumerge.runs.evolve.objective import objective
from resumerge.runs.evolve.search import Planned, SearchOptions, plan_search
from resumerge.runs.evolve.spec import Task, read_spec
from resumerge.runs.evolve.streamed import StreamedCandidates


def write_search(root: Path, base: Path, tuned: Sequence[Path], *, lines: int, granularity: int,
                 method: str = "task_arithmetic", normalize: bool | None = None) -> Path:
    """The search's config in ``root`` (its objective texts: the first ``lines`` lines of each domain's training
    file; ``method`` ties or task_arithmetic, ``normalize`` None for the method's default); returns its path."""
    tasks = []
    for (name, _), parent in zip(DOMAINS, tuned, strict=True):
        texts = root / f"{name}_train.txt"
        texts.write_text("".join(f"{line}\n" for line in (DATA / texts.name).read_text().splitlines()[:lines]))
        tasks.append({"kl": {"parent": str(parent), "texts": str(texts)}})
    config = root / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"models": [str(p) for p in tuned], "merge_method": method, "base_model": str(base),
                   "layer_granularity": granularity, **({} if normalize is None else {"normalize": normalize})},
        "tasks": tasks}, sort_keys=False))
    return config


def planned_of(config: Path, options: SearchOptions) -> Planned:
    """The search ``config`` asks for (SmolLM2's 30 layers)."""
    return plan_search(read_spec(config.read_text()), 30, options)


def baselines(planned: Planned) -> dict[str, dict[str, Any]]:
    """The merges a search is held to: ``default`` (mergekit-evolve's first genotype's config, whatever x0 the
    search started from) and ``linear`` (the two fine-tunes weighted 1/2 each, in the candidates' dtype)."""
    first = planned.config_of(initial_genotype(planned.layout))
    models = planned.spec.genome.models
    linear = {"merge_method": "linear", "models": [{"model": m, "parameters": {"weight": 1 / len(models)}}
                                                   for m in models],
              "dtype": first["dtype"]}
    return {"default": first, "linear": linear}


def held_out_tasks(tuned: Sequence[Path]) -> tuple[Task, ...]:
    """Each fine-tune's KL on its own domain's held-out texts (never trained on, never searched on)."""
    return tuple(Task("kl", f"kl:{parent.name}:{name}_heldout.txt", 1.0, "kl", str(parent),
                      str(DATA / f"{name}_heldout.txt"))
                 for (name, _), parent in zip(DOMAINS, tuned, strict=True))


def scored(store: Path, tasks: Sequence[Task], configs: Mapping[str, Mapping[str, Any]],
           tokenizer: Path) -> dict[str, dict[str, float]]:
    """Each named merge config's figure per task, from evolve's own streamed pass (one generation of them)."""
    names = list(configs)
    store.mkdir(parents=True, exist_ok=True)

    def population(texts: Sequence[str]) -> Any:
        return api.open_population(texts, settings=api.Settings(state_dir=store / "state", resources=Resources()))

    figures = StreamedCandidates(store, tasks, population, tokenizer, StateDir.resolve(None)).score(
        1, [configs[n] for n in names], lambda _: None, lambda _, __: None)
    return dict(zip(names, figures, strict=True))


def objective_of(planned: Planned, figures: Mapping[str, float]) -> float:
    """The search's objective for a candidate's figures."""
    return objective(planned.spec.tasks, figures)
