""":func:`lm_eval`: lm-eval's own command (``lm-eval run|ls|validate``, parsed by lm-eval's own parser) run with
``--model resumerge`` registered, so every flag means what lm-eval means by it and its files, W&B, trackio and hub
logging are lm-eval's own.

lm-eval's ``run`` builds the model from its registry inside ``simple_evaluate``; for ``--model resumerge`` this
module switches ``lm_eval.simple_evaluate`` for the one call (under a lock, put back after, as
:func:`~resumerge.merge.store.hubrepo.xet_disabled` switches hub's global) to decide what lm-eval cannot: ``--use_cache
PATH`` is resumerge's journal kept in the folder PATH (lm-eval's own SQLite cache would hold answers keyed without
the model; the journal is keyed by the model's files and each pass's tokens, answers a rerun without reading a weight
byte, and resumes a killed pass at its layer), recorded in the results' config as lm-eval records it; sampling asked
by ``--gen_kwargs`` is refused before anything is read; and the model is opened (a merge config as the merge it
describes, never written) with what it holds closed when the evaluation ends."""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.lm import ResumergeLM
    from resumerge.analyses.evaluation.registered import ModelArgs

# Held while lm_eval.simple_evaluate is switched: one process-wide attribute (two evaluations in threads would each
# save the other's wrapper and put it back for good).
_SWITCH = threading.Lock()


def lm_eval(args: argparse.Namespace, *, command: str) -> None:
    """Run ``args``, lm-eval's own parsed command line (``lm_eval._cli.HarnessCLI``'s namespace), with ``--model
    resumerge`` registered; ``command``: the shell command that runs it again (said when it is interrupted: the
    rerun resumes each pass where it stopped). lm-eval writes and logs what it writes and logs for any model.
    Raises :class:`UsageError` (exit 2) for what resumerge cannot honour: an unknown ``--model_args`` key, sampling
    (``--gen_kwargs do_sample=True`` or a temperature above 0: resumerge generates greedily), ``--use_cache`` and
    ``state_dir=`` naming two places."""
    from resumerge.analyses.evaluation.registered import MODEL_NAME, ModelArgs, register

    register()
    if getattr(args, "command", None) != "run":
        args.func(args)
        return
    if args.model == MODEL_NAME:  # refused before lm-eval starts a W&B run or reads a task (again below: --config)
        ModelArgs.of(args.model_args or {}, {})
        _greedy(args.gen_kwargs)
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
    """``simple_evaluate(**options)`` for ``--model resumerge``: the cache its journal, the model opened here."""
    from resumerge.analyses.evaluation.registered import opening

    cache = options.get("use_cache")
    _greedy(options.get("gen_kwargs"))
    tasks = tuple(str(t) for t in options.get("tasks") or ())  # what the progress file (status) names
    with ExitStack() as held, opening(lambda given: _opened(held, given, cache, device_flag, command, tasks)):
        results = real(**{**options, "use_cache": None})
    if results is not None:
        results["config"]["use_cache"] = cache
    return results


def _greedy(gen_kwargs: Any) -> None:
    """Refuse sampling asked on the command line (one line, exit 2) before any weight is read."""
    if not gen_kwargs:
        return
    from lm_eval.utils import simple_parse_args_string

    given = simple_parse_args_string(gen_kwargs) if isinstance(gen_kwargs, str) else dict(gen_kwargs)
    sampling = given.get("do_sample") is True or float(given.get("temperature") or 0.0) > 0
    if sampling:
        raise UsageError("--gen_kwargs asks for sampling; resumerge generates greedily (the same answers on every "
                         "run and resume)", hint="leave out do_sample and temperature, or give temperature=0")


def _opened(held: ExitStack, given: ModelArgs, cache: str | None, device_flag: str | None, command: str,
            tasks: tuple[str, ...]) -> ResumergeLM:
    """The model ``given`` names, opened for the evaluation (what it holds closed by ``held`` when it ends)."""
    from resumerge.analyses.evaluation.opened import opened_lm
    from resumerge.analyses.evaluation.run import is_config
    from resumerge.analyses.evaluation.settings import EvalSettings
    from resumerge.api.options import Resources, pass_settings

    if cache is not None and given.state_dir is not None and \
            os.path.abspath(cache) != os.path.abspath(given.state_dir):
        raise UsageError(f"--use_cache {cache} and --model_args state_dir={given.state_dir} name two journals",
                         hint="give one of them: --use_cache is the folder resumerge's journal is kept in")
    state_dir = given.state_dir if given.state_dir is not None else cache
    resources = Resources(max_memory=given.max_memory, device=given.device or device_flag or "cpu",
                          max_gpu_memory=given.max_gpu_memory)
    settings = pass_settings("evaluate", state_dir, resources, None)
    evaluation = EvalSettings(tasks=tasks or ("lm-eval",), max_memory=settings.max_memory, device=resources.device,
                              max_gpu_memory=settings.max_gpu_memory)
    target = given.pretrained
    unwritten = None
    if is_config(target):  # the merge it describes, never written, each tensor's merge admitted by a governor
        from resumerge.api.unwritten import open_unwritten
        from resumerge.memory import MemoryGovernor, SystemProbe, default_budget

        budget = settings.max_memory if settings.max_memory is not None else default_budget(SystemProbe())
        governor = held.enter_context(MemoryGovernor(budget, SystemProbe()))
        unwritten = held.enter_context(open_unwritten(target, state_dir=settings.state.given, governor=governor))
    return held.enter_context(opened_lm(target, evaluation, state=settings.state, command=command,
                                        unwritten=unwritten))
