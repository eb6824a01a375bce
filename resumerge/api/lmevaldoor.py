""":func:`lm_eval`: lm-eval's own command (``lm-eval run|ls|validate``, parsed by lm-eval's own parser) run with
``--model resumerge`` registered, so every flag means what lm-eval means by it and its files, W&B, trackio and hub
logging are lm-eval's own.

lm-eval's ``run`` builds the model from its registry inside ``simple_evaluate``; for ``--model resumerge`` this
module switches ``lm_eval.simple_evaluate`` for the one call (under a lock, put back after, as
:func:`~resumerge.merge.store.hubrepo.xet_disabled` switches hub's global) to decide what lm-eval cannot: ``--use_cache
PATH`` is resumerge's journal kept in the folder PATH (lm-eval's own SQLite cache would hold answers keyed without
the model; the journal is keyed by the model's files and each pass's tokens, answers a rerun without reading a weight
byte, and resumes a killed pass at its layer), recorded in the results' config as lm-eval records it; ``--seed``'s
four figures reach the model (a sampled generation draws from the torch one, journaled under it:
:mod:`~resumerge.analyses.evaluation.genrequests`); a ``--gen_kwargs`` key resumerge does not honour is refused
before anything is read; and the model is opened (a merge config as the merge it describes, never written) with
what it holds closed when the evaluation ends."""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.lm import ResumergeLM
    from resumerge.analyses.evaluation.registered import ModelArgs
    from resumerge.analyses.evaluation.settings import EvalSettings, Seeds
    from resumerge.config.settings import RunSettings

# Held while lm_eval.simple_evaluate is switched: one process-wide attribute (two evaluations in threads would each
# save the other's wrapper and put it back for good).
_SWITCH = threading.Lock()


def lm_eval(args: argparse.Namespace, *, command: str) -> None:
    """Run ``args``, lm-eval's own parsed command line (``lm_eval._cli.HarnessCLI``'s namespace), with ``--model
    resumerge`` registered; ``command``: the shell command that runs it again (said when it is interrupted: the
    rerun resumes each pass where it stopped). lm-eval writes and logs what it writes and logs for any model.
    Raises :class:`UsageError` (exit 2) for what resumerge cannot honour, before lm-eval loads a task: an unknown
    ``--model_args`` key, a device ``run`` refuses too (``mps``; ``cuda`` without a GPU) or a bad size, a
    ``--gen_kwargs`` key resumerge does not generate with (``num_beams``, ``min_p``, ...; sampling with
    ``do_sample``, ``temperature``, ``top_k``, ``top_p`` is honoured), ``--use_cache`` and ``state_dir=`` naming two
    places."""
    from resumerge.analyses.evaluation.registered import MODEL_NAME, ModelArgs, register

    register()
    if getattr(args, "command", None) != "run":
        args.func(args)
        return
    if args.model == MODEL_NAME:  # refused before lm-eval starts a W&B run or reads a task (again below: --config)
        _evaluation(ModelArgs.of(args.model_args or {}, {}), args.use_cache, args.device)[1].checked()
        _honoured(args.gen_kwargs)
    import lm_eval as harness

    real: Callable[..., Any] = harness.simple_evaluate

    def evaluated(*positional: Any, **options: Any) -> Any:
        if positional or options.get("model") != MODEL_NAME:
            return real(*positional, **options)
        return _evaluated(real, options, device_flag=args.device, command=command)

    with _switched(harness, "simple_evaluate", evaluated):
        args.func(args)


@contextmanager
def _switched(module: Any, name: str, value: Any) -> Iterator[None]:
    with _SWITCH:
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, saved)


def _evaluated(real: Callable[..., Any], options: dict[str, Any], *, device_flag: str | None,
               command: str) -> Any:
    """``simple_evaluate(**options)`` for ``--model resumerge``: the cache its journal, the model opened here with
    the seeds ``simple_evaluate`` sets (it sets them itself; the torch one is what a sampled generation draws
    from)."""
    from resumerge.analyses.evaluation.registered import opening
    from resumerge.analyses.evaluation.settings import Seeds

    cache = options.get("use_cache")
    _honoured(options.get("gen_kwargs"))
    tasks = tuple(str(t) for t in options.get("tasks") or ())  # what the progress file (status) names
    default = Seeds()
    seeds = Seeds(options.get("random_seed", default.random), options.get("numpy_random_seed", default.numpy),
                  options.get("torch_random_seed", default.torch), options.get("fewshot_random_seed", default.fewshot))
    with ExitStack() as held, opening(lambda given: _opened(held, given, cache, device_flag, command, tasks,
                                                            seeds)):
        results = real(**{**options, "use_cache": None})
    if results is not None:
        results["config"]["use_cache"] = cache
    return results


def _honoured(gen_kwargs: Any) -> None:
    """Refuse (one line, exit 2) a ``--gen_kwargs`` key resumerge does not generate with, before any weight is
    read (sampling is honoured: :mod:`~resumerge.analyses.evaluation.genrequests`)."""
    if not gen_kwargs:
        return
    from lm_eval.utils import simple_parse_args_string

    from resumerge.analyses.evaluation.genrequests import honoured

    honoured(simple_parse_args_string(gen_kwargs) if isinstance(gen_kwargs, str) else dict(gen_kwargs),
             "--gen_kwargs")


def _opened(held: ExitStack, given: ModelArgs, cache: str | None, device_flag: str | None, command: str,
            tasks: tuple[str, ...], seeds: Seeds) -> ResumergeLM:
    """The model ``given`` names, opened for the evaluation (what it holds closed by ``held`` when it ends)."""
    from resumerge.analyses.evaluation.opened import opened_lm
    from resumerge.analyses.evaluation.run import is_config

    settings, evaluation = _evaluation(given, cache, device_flag)
    evaluation = replace(evaluation, tasks=tasks or evaluation.tasks, seeds=seeds)
    target = given.pretrained
    unwritten = None
    if is_config(target):  # the merge it describes, never written, each tensor's merge admitted by a governor
        from resumerge.api.options import Settings
        from resumerge.api.unwritten import open_unwritten
        from resumerge.machine.memory import MemoryGovernor, SystemProbe, default_budget

        budget = settings.max_memory if settings.max_memory is not None else default_budget(SystemProbe())
        governor = held.enter_context(MemoryGovernor(budget, SystemProbe()))
        unwritten = held.enter_context(open_unwritten(target, Settings(state_dir=settings.state.given),
                                                      governor=governor))
    return held.enter_context(opened_lm(target, evaluation, state=settings.state, command=command,
                                        unwritten=unwritten))


def _run_settings(given: ModelArgs, cache: str | None, device_flag: str | None) -> RunSettings:
    """The run settings of ``--model resumerge`` with ``given`` (``cache``: ``--use_cache``, the journal's folder;
    ``device_flag``: lm-eval's ``--device``), as ``api.evaluate`` makes them; :class:`UsageError` (exit 2) for a
    bad size or for ``--use_cache`` and ``state_dir=`` naming two journals."""
    from resumerge.api.options import Resources, Settings, settings_for

    if cache is not None and given.state_dir is not None and \
            os.path.abspath(cache) != os.path.abspath(given.state_dir):
        raise UsageError(f"--use_cache {cache} and --model_args state_dir={given.state_dir} name two journals",
                         hint="give one of them: --use_cache is the folder resumerge's journal is kept in")
    resources = Resources(max_memory=given.max_memory, device=_device(given, device_flag),
                          max_gpu_memory=given.max_gpu_memory)
    state_dir = given.state_dir if given.state_dir is not None else cache
    return settings_for(Settings(resources=resources, state_dir=state_dir), "evaluate")  # as api.evaluate's


def _device(given: ModelArgs, device_flag: str | None) -> str:
    """The device the passes run on: ``device=`` of ``--model_args``, else lm-eval's ``--device``, else the CPU."""
    return given.device or device_flag or "cpu"


def _evaluation(given: ModelArgs, cache: str | None, device_flag: str | None) -> tuple[RunSettings, EvalSettings]:
    """The run's and the evaluation's settings for ``given`` (its tasks lm-eval's, named later): what
    :meth:`EvalSettings.checked` refuses (a device ``run`` refuses too, ``mps``, or ``cuda`` without a GPU) and
    :func:`_run_settings` are refused in one line, exit 2, before lm-eval loads a task."""
    from resumerge.analyses.evaluation.settings import EvalSettings

    settings = _run_settings(given, cache, device_flag)
    return settings, EvalSettings(tasks=("lm-eval",), max_memory=settings.max_memory,
                                  device=_device(given, device_flag), max_gpu_memory=settings.max_gpu_memory)
