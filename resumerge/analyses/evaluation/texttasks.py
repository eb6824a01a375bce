"""``check``'s figures as tasks: the one owner of NLL and KL scoring on texts, for ``eval`` (``--tasks nll:FILE`` and
``kl:PARENT:FILE`` beside lm-eval's tasks) and for ``evolve``'s ``{nll: {texts}}`` and ``{kl: {parent, texts}}``
objectives.

- ``nll:FILE``: the model's negative log-likelihood per predicted token of the texts in FILE (one a line).
- ``kl:PARENT:FILE``: KL(PARENT ‖ model) per predicted token, averaged over every predicted position of the texts:
  how far the model moved from what PARENT does on them (``check``'s KL of the merge from a parent).

The texts are tokenized as ``check --prompts FILE --truncate-texts`` tokenizes them (the model's tokenizer, no
template, a text longer than the context cut to it: :func:`shared_texts`; a parent of another vocabulary
compared over the tokens both hold, as ``check`` compares it), the pass is the forward engine's, one decoder
layer of one model at a time (:mod:`.textpass`), and the figures come from :func:`text_heads`, each equal to
``check``'s on the same model and texts. In lm-eval's results object a text task is a task like any other:
``results[NAME]["nll,none"]`` (or ``"kl,none"``), with its ``configs``, ``versions``, ``n-shot`` and
``higher_is_better`` entries (:func:`result_entries`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.errors import UsageError
from resumerge.forward.compared.heads import kl_at, logprobs, nll_sum, shared, targets_of
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.text.tokens import Texts, cached_sequences
from resumerge.forward.text.vocabs import SharedVocab
from resumerge.machine.torch_import import torch

NLL, KL = "nll", "kl"
KINDS = (NLL, KL)
VERSION = 1  # of the figures' definition: lm-eval's ``versions`` entry of a text task
OUTPUT_TYPE = "resumerge_texts"


@dataclass(frozen=True)
class TextTask:
    """One text task: ``kind`` :data:`NLL` or :data:`KL`, the ``texts`` file (one text a line), the ``parent`` a
    :data:`KL` task measures from (a folder, GGUF file or ``hf://`` repo), and its ``name`` in the results (as the
    user wrote it)."""

    kind: str
    texts: str
    parent: str | None = None
    name: str = ""

    @property
    def metric(self) -> str:
        """The metric's name in the results (``nll`` or ``kl``)."""
        return self.kind

    def checked(self) -> TextTask:
        """This task, or :class:`UsageError` (exit 2) where its texts file is not a file."""
        if not Path(self.texts).is_file():
            raise UsageError(f"task {self.name}: no such texts file {self.texts}",
                             hint="give a text file, one text a line: nll:FILE or kl:PARENT:FILE")
        return self


def text_task(word: str) -> TextTask | None:
    """The text task ``word`` names (``nll:FILE``, ``kl:PARENT:FILE``; FILE may not hold ``:``, PARENT may: an
    ``hf://`` repo), None for any other word (an lm-eval task); :class:`UsageError` for one that starts so but is
    malformed."""
    kind, sep, rest = word.partition(":")
    if not sep or kind not in KINDS:
        return None
    if kind == NLL:
        if not rest:
            raise UsageError(f"task {word} names no texts file", hint="write it nll:FILE")
        return TextTask(NLL, rest, None, word)
    parent, sep, texts = rest.rpartition(":")
    if not sep or not parent or not texts:
        raise UsageError(f"task {word} is not kl:PARENT:FILE",
                         hint="name the parent model and the texts file, e.g. kl:./parent:texts.txt")
    return TextTask(KL, texts, parent, word)


def shared_texts(directories: Sequence[Path], configs: Sequence[Mapping[str, Any]], paths: Sequence[str],
                 task: TextTask, cache: Path, option: str = "--prompts") -> Texts:
    """The task's token sequences for the models at ``directories`` (the scored model first; a :data:`KL` task's
    parent second) as ``check --prompts --truncate-texts`` makes them, remembered under ``cache``, and how the two
    vocabularies meet where they differ (check's rule, :mod:`resumerge.forward.text.vocabs`: the KL over the
    tokens both hold; a text holding a token one lacks, or models that share none, refused in one line). ``eval``'s
    text tasks and ``evolve``'s objectives (a candidate first, the parent second) take them here alike, so a
    candidate's figure is the one ``eval`` gives its written merge. ``option``: how a refusal names the texts file."""
    return cached_sequences(directories, Path(task.texts), cache, configs=configs, paths=paths, cut=True,
                            option=option)


@dataclass(frozen=True)
class TextFigures:
    """Per scored model: its ``nll`` per predicted token and ``kl``, KL(parent ‖ it) per predicted token (None
    without a parent); ``tokens`` predicted."""

    nll: list[float]
    kl: list[float | None]
    tokens: int

    def figure(self, task: TextTask, model: int = 0) -> float:
        """``task``'s figure for scored model ``model``."""
        if task.kind == KL:
            found = self.kl[model]
            assert found is not None, "a kl task's pass has a parent"
            return found
        return self.nll[model]

    def to_json(self) -> dict[str, Any]:
        return {"nll": self.nll, "kl": self.kl, "tokens": self.tokens}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TextFigures:
        return cls([float(v) for v in doc["nll"]], [None if v is None else float(v) for v in doc["kl"]],
                   int(doc["tokens"]))


def text_heads(streams: Sequence[ModelStream], hidden: list[list[torch.Tensor]],
               batches: Sequence[Sequence[Sequence[int]]], parent: bool, vocab: SharedVocab | None = None
               ) -> TextFigures:
    """The figures of every scored model from its last hidden states (``hidden``: per model, per batch; the
    ``batches``' token sequences): its NLL, and with a ``parent`` (the last of ``streams``, not scored) KL(parent ‖
    it). Batch by batch, the parent's log-probabilities of a batch held while every scored model's are compared
    with them; every sum over the same positions in the same order as ``check``'s heads
    (:func:`~resumerge.forward.compared.heads.head_figures`), so the figures are its figures. Where the parent's
    vocabulary differs (``vocab``: model 0 the scored models', 1 the parent's), each NLL is over the scored model's
    own vocabulary and the KL over the shared tokens, as check takes them."""
    count = len(streams) - (1 if parent else 0)
    tokens = sum(len(s) - 1 for batch in batches for s in batch)
    targets = targets_of(batches, vocab, 0)
    nll = [0.0] * count
    kl: list[list[torch.Tensor]] = [[] for _ in range(count)]
    rows = [logprobs(s, hidden[m], batches) for m, s in enumerate(streams)]
    for b in range(len(batches)):
        theirs = [shared(vocab, 1, lp) for lp in next(rows[-1])] if parent else []
        for m in range(count):
            for r, found in enumerate(next(rows[m])):
                nll[m] = nll_sum(found, targets[b][r], nll[m])
                if parent:
                    kl[m].append(kl_at(theirs[r], shared(vocab, 0, found)))
    for each in rows:  # past its last batch: its head's weights are let go
        next(each, None)
    means: list[float | None] = [float(torch.cat(k).double().mean()) if parent else None for k in kl]
    return TextFigures([n / tokens for n in nll], means, tokens)


def result_entries(task: TextTask, value: float, tokens: int, texts: int,
                   vocabulary: str | None = None) -> dict[str, Any]:
    """``task``'s entries in lm-eval's results object, by section (``results``, ``configs``, ``versions``,
    ``n-shot``, ``higher_is_better``, ``n-samples``), as lm-eval writes its own tasks' (``texts``: how many were
    scored, ``tokens``: the positions predicted; ``vocabulary``: how a parent's other vocabulary met the model's,
    check's line)."""
    config: dict[str, Any] = {"task": task.name, "output_type": OUTPUT_TYPE, "texts": task.texts,
                              "metric_list": [{"metric": task.metric, "higher_is_better": False}],
                              "tokens": tokens}
    if task.parent is not None:
        config["parent"] = task.parent
    if vocabulary is not None:
        config["vocabulary"] = vocabulary
    return {"results": {"alias": task.name, f"{task.metric},none": value},
            "configs": config, "versions": VERSION, "n-shot": 0,
            "higher_is_better": {task.metric: False}, "n-samples": {"original": texts, "effective": texts}}
