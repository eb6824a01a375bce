"""CMA-ES's state as plain numbers: a search restored from the recorded genotypes and objectives (as JSON would
hold them) proposes what the uninterrupted one proposes, to the bit, whatever else drew from numpy's global
generator meanwhile; a recorded generation another strategy would not propose is refused; the first generation's
first candidate is the starting genotype itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from resumerge.errors import RefusedError
from resumerge.runs.evolve.strategy import Search, Settings

SETTINGS = Settings((0.5, 0.5, 1.0, 1.0), 1 / 6, 3, 11, 30)


def _sphere(x: list[float]) -> float:
    return sum((v - 0.3) ** 2 for v in x)


def test_a_restored_search_goes_on_as_the_whole_one() -> None:
    whole = Search(SETTINGS)
    history = []
    while not whole.done():
        asked = whole.ask()
        np.random.rand(7)  # someone else's draws from numpy's global generator change nothing
        objectives = [_sphere(x) for x in asked]
        whole.tell(objectives)
        history.append((asked, objectives))
    assert len(history) >= 4 and history[0][0] != history[1][0]
    kept = json.loads(json.dumps(history))  # what state.json holds
    for told in range(len(history)):
        again = Search.restore(SETTINGS, kept[:told])
        assert again.ask() == history[told][0]
    assert Search.restore(SETTINGS, kept).done()


def test_a_generation_this_strategy_would_not_propose_is_refused() -> None:
    asked = Search(SETTINGS).ask()
    changed = [[*asked[0][:-1], asked[0][-1] + 1e-12], *asked[1:]]
    with pytest.raises(RefusedError, match="generation 1 recorded in STORAGE"):
        Search.restore(SETTINGS, [(changed, [1.0, 2.0, 3.0])])
    other_seed = Settings(SETTINGS.x0, SETTINGS.sigma0, 3, 12, 30)
    with pytest.raises(RefusedError):
        Search.restore(other_seed, [(asked, [1.0, 2.0, 3.0])])


def test_the_first_candidate_is_x0_and_the_rest_are_the_seeds_own_draws() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import cma
    asked = Search(SETTINGS).ask()
    assert asked[0] == list(SETTINGS.x0)  # scored and told like any candidate: a search never ends worse than x0
    draws = np.random.RandomState(SETTINGS.seed)
    plain = cma.CMAEvolutionStrategy(list(SETTINGS.x0), SETTINGS.sigma0, {
        "popsize": 3, "randn": draws.randn, "verbose": -9, "verb_log": 0, "verb_disp": 0, "seed": float("nan")})
    assert asked[1:] == [[float(v) for v in x] for x in plain.ask()[:2]]


def test_max_fevals_is_exact_the_last_generation_cut_to_what_is_left() -> None:
    settings = Settings(SETTINGS.x0, SETTINGS.sigma0, 3, SETTINGS.seed, 7)
    whole = Search(settings)
    history = []
    while not whole.done():
        asked = whole.ask()
        whole.tell([_sphere(x) for x in asked])
        history.append((asked, [_sphere(x) for x in asked]))
    assert [len(asked) for asked, _ in history] == [3, 3, 1] and whole.evaluations == 7
    uncut = Search(Settings(SETTINGS.x0, SETTINGS.sigma0, 3, SETTINGS.seed, 9))
    for _, objectives in history[:2]:
        uncut.ask()
        uncut.tell(objectives)
    assert history[2][0] == uncut.ask()[:1]  # cma's own first candidate of that generation
    restored = Search.restore(settings, json.loads(json.dumps(history)))
    assert restored.done() and restored.evaluations == 7
    with pytest.raises(ValueError, match="2 objectives told for 1"):
        again = Search.restore(settings, history[:2])
        again.ask()
        again.tell([1.0, 2.0])
