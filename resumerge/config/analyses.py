"""Every analysis, one row each (:data:`ANALYSES`, all by name: ``module:name``, imported on first use): the CLI's
commands (:func:`resumerge.cli.parsers.commands`), the API's names (:mod:`resumerge.api`) and ``status``'s walk of
the analyses (:mod:`resumerge.api.analyses`) read it. A new analysis is its package, its command module and one row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AnalysisRow:
    """One analysis: ``name``, its command's (``resumerge NAME``) and the kind ``status`` names its folder by;
    ``runs`` its command's runner, ``module:function``, handed the parsed arguments, whose module declares the
    command's ``HELP``, ``DESCRIPTION`` and ``add_arguments(parser)``; ``analysis`` its class
    (:class:`resumerge.api.analyses.Analysis`; None: a command that keeps no folder of its own); ``api`` the names
    :mod:`resumerge.api` offers for it, ``module:name`` each."""

    name: str
    runs: str
    analysis: str | None
    api: tuple[str, ...]


_CALLS = "resumerge.api.calls"
# In the order `resumerge --help` lists their commands (after tokensurgeon's, before demo's).
ANALYSES: tuple[AnalysisRow, ...] = (
    AnalysisRow("check", "resumerge.cli.checkcmd:run_check_command", "resumerge.analyses.check.analysis:CheckAnalysis",
                (f"{_CALLS}:check",)),
    AnalysisRow("eval", "resumerge.cli.evalcmd:run_eval_command",
                "resumerge.analyses.evaluation.analysis:EvalAnalysis", (f"{_CALLS}:evaluate",)),
    AnalysisRow("lm-eval", "resumerge.cli.lmevalcmd:run_lm_eval_command", None, ("resumerge.api.lmevaldoor:lm_eval",)),
    AnalysisRow("measure", "resumerge.cli.measurecmd:run_measure_command",
                "resumerge.analyses.measure.analysis:MeasureAnalysis",
                (f"{_CALLS}:measure", f"{_CALLS}:estimate_measure")),
    AnalysisRow("evolve", "resumerge.cli.evolvecmd:run_evolve_command", "resumerge.runs.evolve.analysis:SearchAnalysis",
                (f"{_CALLS}:evolve", "resumerge.api.reading:evolve_status", "resumerge.api.evolution:EvolveOutcome")),
)
