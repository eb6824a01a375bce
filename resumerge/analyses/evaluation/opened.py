"""resumerge's model opened for lm-eval's own evaluation (``--model resumerge``: :mod:`.registered`): the model's
headers and tokenizer read, each log-likelihood pass scored on the forward engine and journaled under the state dir
as ``eval`` scores it (:class:`~.job.EvalPasses`, each pass a job of the pass driver: the same journal, so
``eval`` and ``lm-eval`` answer each other's finished passes), and generation (the whole model held where it fits,
else one layer at a time: :mod:`.streamgen`), journaled too: a request set generated once is answered from its file
afterwards, without reading a weight (a sampled one keyed by the torch seed too: another seed generates anew).

Unlike ``eval``, lm-eval's command line hands the model its requests without saying beforehand which tasks generate:
a generation whose smallest step does not fit is refused (one line, exit 2) when lm-eval asks for it, after the
log-likelihood passes, which are journaled and answered again from their files."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from resumerge.analyses.evaluation.job import EvalPasses, EvalProgress, Merged, Watcher, pass_key
from resumerge.analyses.evaluation.lm import ResumergeLM
from resumerge.analyses.evaluation.placed import LayersHere
from resumerge.analyses.evaluation.run import (
    _fits,
    _float32,
    _pass_model,
    evaluating,
    target_max_length,
    target_tokenizer,
)
from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.streamgen import GENERATED, Generation
from resumerge.config.locations import StateDir
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import AnswerFile
from resumerge.forward.job.proof import merge_inputs
from resumerge.machine.memory.allocator import tune_allocator

if TYPE_CHECKING:
    from resumerge.merge.engine.unwritten import UnwrittenMerge


@contextmanager
def opened_lm(target: str, settings: EvalSettings, *, state: StateDir, command: str,
              unwritten: UnwrittenMerge | None = None, watcher: Watcher | None = None) -> Iterator[ResumergeLM]:
    """For the block, the model at ``target`` (``unwritten``: the merge a config describes, never written) as an
    lm-eval model whose passes run under ``settings``' budget and device and are journaled in ``state``;
    ``command``: what continues an interrupted evaluation (said on Ctrl-C, exit 3). Raises :class:`UsageError`
    for a target that is not a model, before any weight is read."""
    model, weights = _pass_model(target, unwritten, state)
    # transformers' tokenizer, as lm-eval's hf model loads it: whether a chat template applies is lm-eval's to say
    tokenizer = target_tokenizer(model, True)
    from lm_eval.models.utils import configure_pad_token

    # the padding token lm-eval's hf model gives a tokenizer without one (recorded in the results file)
    tokenizer = configure_pad_token(tokenizer)
    settings.pass_device()  # refused here (no GPU: exit 2) before a weight is read
    stream = ModelStream(weights, model.opened.config, _float32(), what="resumerge lm-eval", key="TARGET",
                         device=settings.pass_device().name)
    restore_allocator = tune_allocator()
    merged = Merged.of(unwritten)
    inputs = merge_inputs([unwritten.plan], state) if unwritten is not None else ([], [])
    progress = EvalProgress(target, model, settings.tasks, command, watcher)
    passes = EvalPasses(stream, model, settings, state, progress, LayersHere(), merged, inputs)

    generation = Generation(model, weights, settings, lambda digest: state.evals_dir / pass_key(
        model, "generate_until", digest, merged), command, lambda: _fits(stream, settings), inputs=inputs,
        said=passes.said)

    def generated(requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
        digest = generation.key(requests)  # with the model's generation_config.json (a setting refused: exit 2)
        kept = AnswerFile(state.evals_dir / pass_key(model, "generate_until", digest, merged) / GENERATED, _texts)
        found = kept.read()
        if found is not None:
            return found
        answers = generation(lm, requests)
        kept.write(answers)
        return answers

    lm = ResumergeLM(tokenizer, target_max_length(model, tokenizer), passes, generator=generated)
    with evaluating(stream, restore_allocator, progress, command):
        yield lm


def _texts(doc: Any) -> list[str]:
    """A generation's answers as kept (``generated.json``)."""
    return [str(text) for text in doc]
