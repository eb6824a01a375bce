"""A check's token sequences (and how its models' vocabularies meet, :mod:`.vocabs`), remembered in the state
dir: a resumed check (or the same check asked again) does not load the tokenizer again to find which check it is.

Loading the tokenizer (transformers' ``AutoTokenizer``) is one of the costs a killed and resumed check pays twice,
1-2.4 s of a resume on the shared bench machine (bench/RESULTS.md, issue 57). The sequences are kept under a key of
everything they depend on: each candidate folder's path and its files other than weights (name, size, modification
time: a changed tokenizer or template is a new key), the prompts (the built-in texts, or the file's bytes), whether
long texts are cut, the versions of transformers, tokenizers and resumerge, and how tokens of different
vocabularies are matched (:data:`~.vocabs.MATCHED_BY`). Anything unreadable is computed again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.errors import UsageError
from resumerge.forward.text import texts as loaders
from resumerge.forward.text.texts import BUILT_IN, Text, context_of, named
from resumerge.forward.text.vocabs import (
    MATCHED_BY,
    SharedVocab,
    model_rows,
    refuse_past_rows,
    refuse_unshared,
    same_vocabularies,
    shared_vocab,
)
from resumerge.machine.durable import write_file_atomic

TOKENS_DIR = "tokens"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz")


@dataclass(frozen=True)
class Texts:
    """A check's token sequences (the ids of the tokenizer that cut them) and how the models' vocabularies meet
    (None: they are one; see :mod:`.vocabs`)."""

    tokens: list[list[int]]
    vocab: SharedVocab | None


def cached_sequences(directories: Sequence[Path], prompts_file: Path | None, cache: Path, *,
                     configs: Sequence[Mapping[str, Any]] = (), paths: Sequence[str] = (), cut: bool = False,
                     on_miss: Callable[[], None] | None = None, option: str = "--prompts") -> Texts:
    """:func:`~resumerge.forward.text.texts.sequences` of the tokenizer that cuts the texts (the first of
    ``directories`` that holds one where the models' vocabularies are one, else :func:`~.vocabs.shared_vocab`'s),
    each within the models' context (``configs``: their config.json; ``cut``: a longer text cut rather than
    refused), kept under ``cache`` (the state dir's checks folder) and read from there when nothing they depend on
    changed. Refuses (exit 2) texts the models cannot be compared on (:func:`~.vocabs.refuse_unshared`).
    ``on_miss`` is called before a tokenizer is loaded (seconds: transformers and torch imported); ``option``: how
    a refusal names the file (``--prompts``; ``texts`` for an ``evolve`` objective's)."""
    key = _key(directories, prompts_file, cut)
    path = cache / TOKENS_DIR / f"{key}.json" if key is not None else None
    if path is not None:
        found = _read(path)
        if found is not None:
            return found
    if on_miss is not None:
        on_miss()
    names = list(paths) or [os.fspath(d) for d in directories]
    rows = [model_rows(c) for c in configs] or [None] * len(directories)
    if same_vocabularies(directories, rows):
        tokenizer, vocab = load_tokenizer(directories), None
    else:
        tokenizer, vocab = shared_vocab(directories, rows, _tokenizer_of)
        if tokenizer is None:
            tokenizer = load_tokenizer(directories)  # none has one: its one line
    texts = named(tokenizer, prompts_file, context_of(list(zip(names, configs)), cut), option=option,
                  chat=vocab is None)
    if vocab is None:
        refuse_past_rows(tokenizer, texts, rows, names)
    else:
        texts = _shared_built_ins(vocab, texts, names) if prompts_file is None else texts
        refuse_unshared(vocab, [t.ids for t in texts], names, [t.where for t in texts])
    found = Texts([t.ids for t in texts], vocab)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {"tokens": found.tokens, "vocab": vocab.to_json() if vocab is not None else None}
            write_file_atomic(path, json.dumps(doc).encode())
        except OSError:  # a read-only state dir: the check runs all the same
            pass
    return found


def _shared_built_ins(vocab: SharedVocab, texts: list[Text], names: Sequence[str]) -> list[Text]:
    """The built-in texts the models can be compared on (every token of each held by all): one that holds a token
    some model lacks is left out with a warning, never refused (no one can edit it); all left out: refused by
    :func:`~.vocabs.refuse_unshared`, naming the first."""
    held = vocab.held
    kept = [t for t in texts if all(held[i] for i in t.ids)]
    if not kept:
        return texts
    for text in texts:
        if text not in kept:
            token = next(i for i in text.ids if not held[i])
            logging.getLogger(__name__).warning(
                "%s is left out of the check: its token %r is not held by every one of %s", text.where,
                dict(vocab.alignment.names).get(token, str(token)), ", ".join(names))
    return kept


def load_tokenizer(directories: Sequence[Path]) -> Any:
    """The tokenizer that cuts the texts of models whose vocabularies are one: read without transformers where it
    would load it unchanged (:mod:`resumerge.forward.text.plaintok`; a check only encodes texts and renders the chat
    template with it), else by transformers."""
    return loaders.load_tokenizer(directories, plain=True)


def _tokenizer_of(directory: Path) -> Any:
    """``directory``'s tokenizer as transformers loads it (its vocabulary is read; without transformers where it
    would load it unchanged: :mod:`resumerge.forward.text.plaintok`), None where it has none that loads."""
    try:
        return loaders.load_tokenizer([directory], plain=True)
    except UsageError:
        return None


def _key(directories: Sequence[Path], prompts_file: Path | None, cut: bool) -> str | None:
    """What the sequences depend on, hashed; None when it cannot be known (then nothing is kept)."""
    try:
        folders = [[os.path.abspath(d), sorted([e.name, e.stat().st_size, e.stat().st_mtime_ns]
                                                for e in os.scandir(d) if e.is_file()
                                                and not e.name.endswith(_WEIGHTS))]
                   for d in directories]
        prompts = (hashlib.sha256(prompts_file.read_bytes()).hexdigest() if prompts_file is not None
                   else [list(pair) for pair in BUILT_IN])
    except OSError:  # sequences() says what is wrong with the prompts file
        return None
    versions: list[str | None] = []
    for dist in ("transformers", "tokenizers", "resumerge"):
        try:
            versions.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            versions.append(None)
    return hashlib.sha256(json.dumps([folders, prompts, versions, cut, MATCHED_BY]).encode()).hexdigest()[:32]


def _read(path: Path) -> Texts | None:
    try:
        doc = json.loads(path.read_text())
        tokens, vocab = doc["tokens"], doc["vocab"]
        found = Texts(tokens, SharedVocab.from_json(vocab) if vocab is not None else None)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if (not isinstance(tokens, list) or not tokens
            or not all(isinstance(s, list) and len(s) >= 2 and all(type(i) is int for i in s) for s in tokens)):
        return None
    return found
