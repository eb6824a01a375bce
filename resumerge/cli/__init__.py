"""The command line and the terminal: argument parsing, one :mod:`resumerge.api` call per command, and the only
module that imports rich (``render``).

The API decides what a run is and owns every option and guard; a command only parses argv, makes its one call and
shows the result (``render`` reads the result types of store, engine and recipes). ``resumerge demo`` and the
tiny-model generator it uses live here too.

``tokensurgeon``'s flag choices are read from ``transplant``.

May import: api, analyses, errors, config, machine, merge.store, merge.plan, merge.engine, analyses.estimate,
runs.recipes, runs.evolve, runs.transplant.
"""

__all__ = [
    "commands",
    "demo",
    "ignoredflags",
    "knobs",
    "modelgen",
    "parsers",
    "reference",
    "render",
    "statusshow",
    "trafficline",
]
