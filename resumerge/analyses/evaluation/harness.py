"""lm-eval's evaluation of resumerge's model, through lm-eval's own ``evaluate``: the tasks (loaded once, when the
evaluation checked them: :class:`~.tasks.LoadedTasks`) set up as
lm-eval's ``simple_evaluate`` sets them up for ``eval``'s options (the seeds, ``num_fewshot``, the few-shot seed,
the tracker told the experiment), and its results object completed as ``simple_evaluate`` completes it (``config``,
``git_hash``, ``date``, the tokenizer's tokens) — less the environment: ``simple_evaluate`` describes the machine
in every results object (lm-eval's ``add_env_info``: torch's ``collect_env`` runs ``pip list`` and a dozen other
programs, about 1.2 s of CPU), which an evolve search paid for each candidate it scored and an ``eval`` that prints
its table for nothing. :func:`add_environment` records it where the object is kept: lm-eval's results file
(:mod:`.outputs`), at the place ``simple_evaluate`` gives it."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import time
from collections.abc import Mapping
from typing import Any

from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.errors import UsageError

# lm-eval's words for a model whose name says it was tuned to chat (it warns where no chat template is applied).
_CHAT_NAMES = ("inst", "chat")
_BOOTSTRAP_ITERS = 100000  # simple_evaluate's default: the stderr figures' bootstrap
_LOG = logging.getLogger("lm_eval.evaluator")  # simple_evaluate's warnings, said where it says them


def evaluate_tasks(lm: Any, target: str, settings: EvalSettings, loaded: Mapping[str, Any],
                   tracker: Any) -> dict[str, Any]:
    """lm-eval's results of ``settings.lm_tasks`` on ``lm``, ``target`` its ``model_args``' ``pretrained``, as
    ``simple_evaluate`` returns them for these options but the environment (:func:`add_environment`); ``loaded``:
    those tasks as lm-eval's ``TaskManager.load`` gives them (:meth:`.tasks.LoadedTasks.runs`: loaded once, when
    they were checked, never run before); ``tracker`` (None: no ``output_path``) is told the experiment as
    ``simple_evaluate`` tells it."""
    import numpy as np
    from lm_eval.evaluator import evaluate
    from lm_eval.loggers.utils import add_tokenizer_info
    from lm_eval.utils import set_torch_seed

    started = time.time()
    # the folder as named, not its spelling: "out-linear/" (a shell's completion) made lm-eval's folder "out-linear__"
    model_args = {"pretrained": target.rstrip("/") or target}
    if not settings.apply_chat_template and any(word in target.lower() for word in _CHAT_NAMES):
        _LOG.warning("pretrained=%s appears to be an instruct or chat variant but chat template is not applied "
                     "(--apply-chat-template applies it)", target)
    seeds = settings.seeds  # each set where given, as simple_evaluate sets them (None: left as it is)
    if seeds.random is not None:
        random.seed(seeds.random)
    if seeds.numpy is not None:
        np.random.seed(seeds.numpy)
    if seeds.torch is not None:
        set_torch_seed(seeds.torch)
    # simple_evaluate loads the tasks here, after its seeds: loading draws from none of them (a task keeps its own
    # random.Random, seeded below; datasets its own fingerprint generator), so tasks loaded earlier run the same.
    for name, task in loaded["tasks"].items():
        _set_fewshot(name, task, settings.num_fewshot)
        task.set_fewshot_seed(seed=seeds.fewshot)
    chat = settings.apply_chat_template
    if tracker is not None:
        tracker.general_config_tracker.log_experiment_args(
            model_source="CUSTOM", model_args=model_args, system_instruction=None,
            chat_template=lm.chat_template(chat) if chat else None, fewshot_as_multiturn=True)
    results = evaluate(lm=lm, task_dict=loaded, limit=settings.whole_limit, log_samples=settings.log_samples,
                       bootstrap_iters=_BOOTSTRAP_ITERS, apply_chat_template=chat, fewshot_as_multiturn=True)
    if results is None:  # lm-eval returns None on ranks other than 0 only; one process has rank 0
        raise UsageError("lm-eval returned no results")
    results = dict(results)
    results["config"] = {
        "model": type(lm).__name__, "model_args": model_args, "batch_size": None, "batch_sizes": [],
        "device": None, "use_cache": None, "limit": settings.whole_limit, "bootstrap_iters": _BOOTSTRAP_ITERS,
        "gen_kwargs": None, "random_seed": seeds.random, "numpy_seed": seeds.numpy,
        "torch_seed": seeds.torch, "fewshot_seed": seeds.fewshot}
    results["git_hash"] = git_hash()
    results["date"] = started
    add_tokenizer_info(results, lm)
    return results


def git_hash() -> str | None:
    """The working directory's git commit as lm-eval's ``get_git_commit_hash`` finds it (``git describe --always``,
    else its reading of ``.git``), without git's ``fatal: not a git repository`` on the terminal: lm-eval lets git
    write to the process's stderr, which every ``eval`` run outside a clone printed (issue 87)."""
    try:
        found = subprocess.run(["git", "describe", "--always"], capture_output=True, check=True)
        return found.stdout.decode().strip()
    except (subprocess.CalledProcessError, FileNotFoundError):  # no repository here, or no git installed
        from lm_eval.loggers.utils import get_commit_from_path

        found_here: str | None = get_commit_from_path(os.getcwd())
        return found_here


def _set_fewshot(name: str, task: Any, num_fewshot: int | None) -> None:
    """``num_fewshot`` given overrides the task's own, but where its config sets 0 (lm-eval's rule, warned as
    lm-eval warns it); not given, a task that sets none gets 0."""
    own = task.get_config("num_fewshot")
    if num_fewshot is None:
        if own is None:
            task.set_config(key="num_fewshot", value=0)
    elif own != 0:
        _LOG.warning("Overwriting default num_fewshot of %s from %s to %s", name, own, num_fewshot)
        task.set_config(key="num_fewshot", value=num_fewshot)


def add_environment(results: dict[str, Any]) -> None:
    """The machine, transformers' and lm-eval's versions and the upper git commit (lm-eval's ``add_env_info``) in
    ``results``, in place, after its ``date`` as ``simple_evaluate`` places them; a results object of text tasks
    alone (no ``date``: lm-eval ran no task) is left as it is, as lm-eval's CLI would leave it."""
    if "date" not in results:
        return
    from lm_eval.loggers.utils import add_env_info

    found: dict[str, Any] = {}
    add_env_info(found)
    names = list(results)
    after = [name for name in names[names.index("date") + 1:] if name not in found]
    moved = {name: results.pop(name) for name in after}
    for name in found:
        results.pop(name, None)
    results.update(found)
    results.update(moved)
