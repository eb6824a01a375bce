"""CMA-ES through the ``cma`` package (what mergekit-evolve runs), seeded, with its state kept as plain numbers.

``cma`` keeps its state in objects it would pickle; a pickle is code, and a search's STORAGE must hold none. The
state here is what decides every later step: the settings (first genotype, sigma0, popsize, seed, max_fevals) and,
per generation told, the genotypes asked and their objectives — lists of floats in JSON, each written with
``repr`` so it reads back to the bit. :meth:`Search.restore` builds a fresh ``CMAEvolutionStrategy`` from the settings
and replays each generation (ask, then tell the recorded objectives): the normal draws come from a
``RandomState`` of the seed that the strategy alone uses (never numpy's global one), so every ask returns the
recorded genotypes again, which is checked to the bit, and the strategy ends in the state it had.

The first generation's first candidate is ``x0`` itself (``cma``'s ``inject``, unchanged: the other candidates are
the first draws of the same seed), so the starting genotype is scored and told like any candidate and a search
never ends worse than where it began. mergekit-evolve's ``cma.fmin2`` never scores ``x0``: its best can be worse than
the default-parameter merge it started from.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from resumerge.errors import RefusedError


@dataclass(frozen=True)
class Settings:
    """What a search starts from: ``x0`` (the first mean), ``sigma0``, ``popsize`` (None: cma's 4 + 3 ln n),
    ``seed`` and ``max_fevals`` (the evaluations after which the search ends)."""

    x0: tuple[float, ...]
    sigma0: float
    popsize: int | None
    seed: int
    max_fevals: int

    def to_json(self) -> dict[str, Any]:
        return {"x0": list(self.x0), "sigma0": self.sigma0, "popsize": self.popsize, "seed": self.seed,
                "max_fevals": self.max_fevals}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Settings:
        return cls(tuple(float(v) for v in doc["x0"]), float(doc["sigma0"]), doc["popsize"], int(doc["seed"]),
                   int(doc["max_fevals"]))


def default_popsize(dimensions: int) -> int:
    """cma's population for ``dimensions`` numbers: 4 + ⌊3 ln n⌋."""
    import math

    return 4 + int(3 * math.log(dimensions))


def _import_cma() -> ModuleType:
    """The ``cma`` package, imported without ``scipy.stats``: cma 4.5's ``fitness_models`` imports scipy.stats's
    ``kendalltau`` at import time (3.7 CPU s of a generation's 27) for its surrogate models alone, which
    ``CMAEvolutionStrategy``'s ask and tell never run, and falls back to its own ``_kendall_tau`` where scipy.stats
    cannot be imported. So scipy.stats is made unimportable while cma is imported (where nothing imported it yet),
    then importable again: a later ``import scipy.stats`` works as before."""
    with warnings.catch_warnings():  # cma warns at import that matplotlib is missing: it plots nothing here
        warnings.simplefilter("ignore")
        blocked = "cma" not in sys.modules and "scipy.stats" not in sys.modules
        if blocked:
            sys.modules["scipy.stats"] = None  # type: ignore[assignment]  # import's own "not importable" mark
        try:
            return importlib.import_module("cma")
        finally:
            if blocked and sys.modules.get("scipy.stats", ModuleType("x")) is None:
                del sys.modules["scipy.stats"]


class Search:
    """A CMA-ES search: :meth:`ask` the next generation's genotypes, :meth:`tell` their objectives (lower is
    better), :meth:`done` once ``max_fevals`` candidates are scored, or earlier where cma's own criteria stop it.

    ``max_fevals`` is a number of evaluations, never passed: where fewer than a generation are left, the last
    generation is cma's first candidates alone, as many as are left, and the search ends with them (cma is not
    told them: it updates from whole generations). mergekit-evolve hands ``max_fevals`` to ``cma.fmin2``, whose
    rule (``countevals - 1 >= maxfevals`` after a whole generation) scores up to a generation more than asked."""

    def __init__(self, settings: Settings) -> None:
        import numpy as np

        cma = _import_cma()
        self.settings = settings
        draws = np.random.RandomState(settings.seed)
        options: dict[str, Any] = {"maxfevals": settings.max_fevals, "randn": draws.randn, "verbose": -9,
                                   "verb_log": 0, "verb_disp": 0, "seed": float("nan")}
        if settings.popsize is not None:
            options["popsize"] = settings.popsize
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._es = cma.CMAEvolutionStrategy(list(settings.x0), settings.sigma0, options)
            # x0 is the distribution's mean: as an injected direction it is zero, and forced, cma returns it as it
            # is (the first candidate of the first ask) and weighs it in its update like any other candidate.
            self._es.inject([np.array(settings.x0, dtype=float)], force=True)
        self._asked: list[list[float]] | None = None
        self.evaluations = 0  # the candidates told, the last generation's too where it was cut to the budget

    @property
    def popsize(self) -> int:
        return int(self._es.popsize)

    def left(self) -> int:
        """The evaluations left of ``max_fevals``."""
        return max(self.settings.max_fevals - self.evaluations, 0)

    def ask(self) -> list[list[float]]:
        """The next generation's genotypes (asked once: asking again returns the same): cma's population, or its
        first :meth:`left` ones where fewer are left (the last generation)."""
        if self._asked is None:
            self._asked = [[float(v) for v in x] for x in self._es.ask()]
        return self._asked[:self.left()]

    def tell(self, objectives: Sequence[float]) -> None:
        """The objectives of the genotypes :meth:`ask` returned, in their order."""
        import numpy as np

        if self._asked is None:
            raise ValueError("tell before ask")
        if len(objectives) != len(self.ask()):
            raise ValueError(f"{len(objectives)} objectives told for {len(self.ask())} candidates asked")
        if len(objectives) == len(self._asked):  # a generation cut to the budget ends the search untold
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._es.tell([np.array(x) for x in self._asked], [float(f) for f in objectives])
        self.evaluations += len(objectives)
        self._asked = None

    def done(self) -> bool:
        """Whether the search has ended: ``max_fevals`` candidates told, or cma's own stop criteria met."""
        return self.evaluations >= self.settings.max_fevals or bool(self._es.stop())

    def figures(self) -> dict[str, Any]:
        """The strategy's state now, for the user: its mean, step size and the diagonal of its covariance."""
        return {"mean": [float(v) for v in self._es.mean], "sigma": float(self._es.sigma),
                "evaluations": self.evaluations}

    @classmethod
    def restore(cls, settings: Settings, history: Sequence[tuple[Sequence[Sequence[float]], Sequence[float]]]
                ) -> Search:
        """The search after the generations of ``history`` (each its genotypes and objectives), replayed; raises
        :class:`RefusedError` where a replayed ask differs from the recorded genotypes (another ``cma``, or a
        search started before the starting genotype was scored first)."""
        search = cls(settings)
        for number, (genotypes, objectives) in enumerate(history, 1):
            asked = search.ask()
            if [list(map(float, x)) for x in genotypes] != asked:
                raise RefusedError(f"generation {number} recorded in STORAGE is not what this cma proposes again",
                                   hint="resume with the resumerge and cma versions that started the search "
                                        "(cma 4.5; a resumerge that did not yet score the starting genotype first)")
            search.tell(objectives)
        return search
