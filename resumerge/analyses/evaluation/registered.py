"""``--model resumerge`` on lm-eval's own command line: the class registered in lm-eval's model registry under that
name (:func:`register`), its ``model_args`` read and checked (:class:`ModelArgs`), and the one seam through which
lm-eval's ``simple_evaluate`` gets the model: the opener of the evaluation under way (:func:`opening`).

lm-eval builds a model from its registry by calling the class's ``create_from_arg_obj(model_args, {batch_size,
max_batch_size, device})``. Opening resumerge's model needs what lm-eval does not hand over (the state dir that
``--use_cache`` names, the command that continues an interrupted run, a merge config's inputs opened and closed with
the evaluation), so the registered class asks the opener that :func:`opening` sets for one evaluation: a context
variable, set and reset around that call, rather than a module-level setting (two evaluations, in two threads, each
see their own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from resumerge.analyses.evaluation.lm import ResumergeLM
from resumerge.errors import UsageError

MODEL_NAME = "resumerge"
# lm-eval's --trust_remote_code adds trust_remote_code=True to model_args for its datasets; resumerge runs no
# model code from a repo (its own modules), so the key is accepted and changes nothing about the model.
_ACCEPTED = ("pretrained", "max_memory", "max_gpu_memory", "device", "state_dir", "trust_remote_code", "dtype")
# What lm-eval hands every model beside model_args; resumerge batches a pass by tokens (each layer read once for
# all requests), so a batch size changes nothing it computes: recorded in the results' config as lm-eval records it.
_HANDED = ("batch_size", "max_batch_size", "device")

Opener = Callable[["ModelArgs"], ResumergeLM]
# The opener of the evaluation under way (None: no resumerge lm-eval call is running).
_OPENER: ContextVar[Opener | None] = ContextVar("resumerge_lm_eval_opener", default=None)


@dataclass(frozen=True)
class ModelArgs:
    """``--model_args`` of ``--model resumerge``: ``pretrained`` (a folder, a GGUF file, an ``hf://`` repo or a
    merge config), ``max_memory`` and ``max_gpu_memory`` (sizes, e.g. ``4GB``), ``device`` (``cpu``, ``cuda[:N]``)
    and ``state_dir`` (where the journal is kept)."""

    pretrained: str
    max_memory: str | None = None
    max_gpu_memory: str | None = None
    device: str | None = None  # None: not in model_args (lm-eval's --device as typed, else the CPU)
    state_dir: str | None = None

    @classmethod
    def of(cls, given: Mapping[str, Any], handed: Mapping[str, Any]) -> ModelArgs:
        """The arguments of ``given`` (lm-eval's parsed ``model_args``; ``handed``: what lm-eval hands every model
        beside them). Raises
        :class:`UsageError` naming a key resumerge does not take, a missing ``pretrained``, or a ``dtype`` other
        than float32 (resumerge scores in float32, as lm-eval's ``hf`` model with ``dtype=float32``)."""
        unknown = sorted(set(given) - set(_ACCEPTED))
        if unknown:
            raise UsageError(f"--model_args {', '.join(unknown)}: not an argument of --model resumerge",
                             hint=f"give only {', '.join(_ACCEPTED[:5])}")
        if not given.get("pretrained"):
            raise UsageError("--model resumerge needs --model_args pretrained=PATH",
                             hint="name a model folder, a GGUF file, hf://NAMESPACE/NAME or a merge config")
        dtype = given.get("dtype")
        if dtype is not None and str(dtype).removeprefix("torch.") not in ("float32", "auto"):
            raise UsageError(f"--model_args dtype={dtype}: resumerge scores in float32",
                             hint="leave out dtype, or give dtype=float32")
        unused = sorted(k for k in handed if k not in _HANDED and handed[k] is not None)
        if unused:  # a later lm-eval handing the model more than 0.4.13 does: named, never ignored
            raise UsageError(f"lm-eval hands --model resumerge {', '.join(unused)}, which it does not take",
                             hint="leave those options out")
        def text(key: str) -> str | None:
            value = given.get(key)
            return None if value is None else str(value)

        return cls(str(given["pretrained"]), text("max_memory"), text("max_gpu_memory"), text("device"),
                   text("state_dir"))


class RegisteredLM(ResumergeLM):
    """The class lm-eval's registry holds under ``resumerge``: built by the opener of the evaluation under way."""

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> ResumergeLM:
        opener = _OPENER.get()
        if opener is None:
            raise UsageError("--model resumerge is opened by resumerge's own door to lm-eval",
                             hint="run resumerge lm-eval --model resumerge ... (or python -m resumerge.lm_eval)")
        return opener(ModelArgs.of(arg_dict, additional_config or {}))

    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None) -> ResumergeLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)


def register() -> None:
    """``resumerge`` in lm-eval's model registry, beside lm-eval's own models (imported first: lm-eval imports
    them only while its registry is empty, so ``resumerge`` alone would hide ``hf``). Idempotent."""
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry, register_model

    if MODEL_NAME not in model_registry:
        register_model(MODEL_NAME)(RegisteredLM)


@contextmanager
def opening(opener: Opener) -> Iterator[None]:
    """For the block, ``--model resumerge`` built by ``opener``."""
    token = _OPENER.set(opener)
    try:
        yield
    finally:
        _OPENER.reset(token)
