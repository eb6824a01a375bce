"""An evaluation's files, as lm-eval's CLI writes them with ``--output_path`` (and ``--log_samples``): its own
``EvaluationTracker`` writes the results file (the machine described in it, as ``simple_evaluate`` describes it:
:func:`~.harness.add_environment`) and each task's samples file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resumerge.analyses.evaluation.harness import add_environment
from resumerge.analyses.evaluation.settings import EvalSettings


def write_outputs(results: dict[str, Any], tracker: Any, settings: EvalSettings) -> tuple[str, ...]:
    """Write ``results`` (and, with ``log_samples``, each task's samples) under ``settings.output_path`` through
    lm-eval's ``tracker`` the evaluation ran with; returns the files written."""
    samples = results.pop("samples", None) if settings.log_samples else None
    root = Path(str(settings.output_path))
    before = {p for p in root.rglob("*") if p.is_file()} if root.is_dir() else set()
    add_environment(results)
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task in results["configs"]:
            if task in samples:  # a text task (nll:FILE, kl:PARENT:FILE) logs no samples
                tracker.save_results_samples(task_name=task, samples=samples[task])
        results["samples"] = samples
    return tuple(sorted(str(p) for p in root.rglob("*") if p.is_file() and p not in before))
