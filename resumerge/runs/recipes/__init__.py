"""Multi-stage recipes (mergekit-multi): one client of the engine that plans every stage of a recipe and drives the
single-merge session path once per stage.

A recipe is parsed (``recipe``), every stage planned up front (``plan``), recorded in its own ledger (``ledger``)
and in OUT (``manifest``; for an ``hf://`` OUT, in the repo: ``hub``), run stage by stage through
:func:`resumerge.merge.engine.session.run_plan` (``run``), estimated (``estimate``) and reported (``view``, what
``status`` shows). Nothing below this package knows that recipes exist; :mod:`resumerge.api` decides when a run
is one.

May import: errors, config, machine, inputs, merge.plan, outputs, merge.store, merge.engine, analyses.estimate,
runs.transplant.
"""

__all__ = [
    "discard",
    "estimate",
    "hub",
    "ledger",
    "ledger_read",
    "manifest",
    "plan",
    "recipe",
    "run",
    "view",
]
