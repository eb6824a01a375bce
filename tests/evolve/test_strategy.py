"""CMA-ES's state as plain numbers: a search restored from the recorded genotypes and objectives (as JSON would
hold them) proposes what the uninterrupted one proposes, to the bit, whatever else drew from numpy's global
generator meanwhile; a recorded generation another strategy would not propose is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from resumerge.errors import RefusedError
from resumerge.evolve.strategy import Search, Settings

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
