"""An evaluation's files, as lm-eval's CLI writes them with ``--output_path`` (and ``--log_samples``): its own
``EvaluationTracker`` writes the results file (the machine described in it, as ``simple_evaluate`` describes it:
:func:`~.harness.add_environment`) and each task's samples file, in a folder named after the model
(:func:`results_folder`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resumerge.analyses.evaluation.harness import add_environment
from resumerge.analyses.evaluation.settings import EvalSettings


def results_folder(target: str) -> str:
    """The folder under ``--output-path`` that the results of the model ``target`` go in: a local model (a folder,
    a GGUF file, a merge config) by its own name, its resolved path's (``merged/`` and ``../out`` are ``merged``
    and ``out``, never ``merged__`` or the hidden ``..__out``), a hub model as lm-eval names one (``org/name``:
    ``org__name``)."""
    from lm_eval.utils import sanitize_model_name

    local = Path(target).expanduser()
    return str(sanitize_model_name(local.resolve().name if local.exists() else target.removeprefix("hf://")))


def write_outputs(results: dict[str, Any], tracker: Any, settings: EvalSettings, target: str) -> tuple[str, ...]:
    """Write ``results`` of the model ``target`` (and, with ``log_samples``, each task's samples) under
    ``settings.output_path`` (in :func:`results_folder`'s folder) through lm-eval's ``tracker`` the evaluation ran
    with; returns the files written."""
    # lm-eval names the folder after model_args' pretrained as typed: a path's slashes and dots kept
    tracker.general_config_tracker.model_name_sanitized = results_folder(target)
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
