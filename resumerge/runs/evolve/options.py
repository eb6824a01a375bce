"""How CMA-ES searches, written once: the API's option group (:class:`resumerge.api.options.Search`) is this record,
and :func:`~resumerge.runs.evolve.search.plan_search` reads it (nothing imported: the API's options stay light)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SearchOptions:
    """How CMA-ES searches (mergekit-evolve's options and defaults): ``max_fevals`` evaluations (the last generation
    cut to what is left), ``popsize`` candidates a generation (None: cma's 4 + 3 ln n), the first step size
    ``sigma0`` and the ``random_seed`` of its draws."""

    max_fevals: int = 100
    popsize: int | None = None
    sigma0: float = 1 / 6
    random_seed: int = 0
