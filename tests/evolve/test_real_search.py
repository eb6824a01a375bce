"""Issue 68's real-weights check: SmolLM2-135M-Instruct and two fine-tunes of it made by transformers (a few
AdamW steps on weather bulletins, a few on recipes: ``realmodel.smollm2_finetunes``, cached once per machine), a
``ties`` genome over two layer groups searched by ``kl`` tasks (each fine-tune on its own training texts). The
search's best merge must beat the merge it started from (mergekit-evolve's first genotype: weights 1/2, densities
1, the default-parameter ties merge) and the uniform linear merge on its objective and on each domain's held-out
texts (never trained on, never searched on), all scored by the search's own streamed pass.

Slow on purpose (real weights: 30 layers, hidden 576): the fine-tunes once per cache, then a search of two
generations of four candidates and the held-out scoring; ``bench/bench_evolve_real.py`` runs a bigger search and
writes the figures."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from realmodel import DOMAINS, smollm2_finetunes

from resumerge import api
from resumerge.evolve.search import SearchOptions
from tests.evolve.realsearch import baselines, held_out_tasks, objective_of, planned_of, scored, write_search

pytestmark = pytest.mark.slow
LINES = 6
GRANULARITY = 15  # two groups of 15 layers: 2 groups x 2 models x (weight, density) = 8 numbers
OPTIONS: dict[str, Any] = {"max_fevals": 7, "popsize": 4, "random_seed": 1}


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base, weather, recipes = smollm2_finetunes()
    root = tmp_path_factory.mktemp("real")
    config = write_search(root, base, [weather, recipes], lines=LINES, granularity=GRANULARITY)
    outcome = api.evolve(config, root / "store", **OPTIONS)
    planned = planned_of(config, SearchOptions(OPTIONS["max_fevals"], OPTIONS["popsize"], 1 / 6,
                                               OPTIONS["random_seed"]))
    tasks = (*planned.spec.tasks, *held_out_tasks([weather, recipes]))
    figures = scored(root / "held-out", tasks, {"best": outcome.best.config, **baselines(planned)}, base)
    return {"outcome": outcome, "planned": planned, "figures": figures, "tuned": (weather, recipes)}


def test_each_fine_tune_moved_its_own_domain() -> None:
    _, *tuned = smollm2_finetunes()
    for (name, _), folder in zip(DOMAINS, tuned, strict=True):
        nll = json.loads((folder / "nll.json").read_text())
        own = f"{name}_heldout.txt"
        assert nll["tuned"][own] < nll["base"][own] - 1.0, (name, nll)  # more than a nat on texts never seen


def test_the_best_merge_beats_the_default_and_the_linear_merge_on_the_objective_and_held_out(
        searched: dict[str, Any]) -> None:
    outcome, planned, figures = searched["outcome"], searched["planned"], searched["figures"]
    best = figures["best"]
    # The pass that scores the held-out texts gives the best candidate the figures the search recorded.
    for task in planned.spec.tasks:
        assert math.isclose(best[task.name], outcome.best.tasks[task.name], rel_tol=1e-6), task.name
    objective = {name: objective_of(planned, found) for name, found in figures.items()}
    held_out = [t.name for t in held_out_tasks(searched["tuned"])]
    for other in ("default", "linear"):
        assert objective["best"] < objective[other], (other, objective)
        for name in held_out:
            assert best[name] < figures[other][name], (other, name, figures)
