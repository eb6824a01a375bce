"""Models whose vocabularies differ, compared over the tokens they share: decided from their tokenizers and
vocabulary sizes before any layer runs, kept with the check's token sequences and in its key (a resumed check
agrees with the one it resumes).

A ``tokenizer_source: union`` merge has more rows than its parents (49,280 against 49,152); a model fine-tuned
with added tokens, more than its base. Their log-probabilities are over different sets, and the check compared
them position by position as if they were one (a crash after the whole pass). The rule, one for every figure:

* Where every model has the same number of rows and the same tokenizer (or none), nothing changes: the
  vocabularies are one, compared by id over every row.
* Otherwise each model's tokens are its tokenizer's (a model without one borrows the texts' tokenizer's), its ids
  below its own row count; the **shared tokens** are those every model holds, matched by token string (the same
  string at the same id where one vocabulary extends the other: "by id"; else "by string"). The texts are cut by
  the tokenizer of the first model (merge, base, parents) whose every token the others hold (a union merge's
  parent's: then every text token is shared), else the merge's; a text that holds a token some model lacks is
  refused in one line (exit 2), as is a check whose models share no token.
* Every model reads the texts as those tokens, each given as its own id of the same string (the hidden states
  stay comparable position by position; a model whose own tokenizer would cut a text otherwise reads it as cut
  for the others, and its NLL may be above what its own cut gives). Its NLL is over its whole vocabulary; KL
  and top-1 agreement are over the shared tokens only: each model's log-probabilities taken at the shared tokens
  and renormalised over them (``lp[S] - logsumexp(lp[S])``, the log-softmax of its logits restricted to S).

The mapping is :class:`resumerge.merge.vocab.VocabAlignment`, as a merge's tokenizer alignment is: over the texts'
tokenizer's tokens by id, each model's row of the same token (-1: it lacks it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from resumerge.errors import UsageError
from resumerge.merge.vocab import VocabAlignment, source_rows
from resumerge.torch_import import torch

# The files that say a tokenizer's vocabulary (its template and settings aside).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


@dataclass(frozen=True)
class SharedVocab:
    """How the models' different vocabularies meet (see the module's rule): ``alignment`` over the texts'
    tokenizer's tokens (``models`` are the indices of the check's models, as strings), ``reference`` the model whose
    tokenizer cut the texts."""

    alignment: VocabAlignment
    reference: int

    @cached_property
    def shared(self) -> torch.Tensor:
        """The texts' tokenizer's ids of the tokens every model holds, in id order."""
        held = np.ones(self.alignment.real_size, dtype=bool)
        for key in self.alignment.models:
            held &= self.alignment.source_rows(key) >= 0
        return torch.from_numpy(np.flatnonzero(held).astype(np.int64))

    def columns(self, m: int) -> torch.Tensor:
        """Model ``m``'s ids of the shared tokens, in the order of :attr:`shared`."""
        return torch.from_numpy(self.alignment.source_rows(str(m))[self.shared.numpy()].copy())

    @property
    def by_id(self) -> bool:
        """Whether every model holds each shared token at the same id (one vocabulary extends the other)."""
        return all(torch.equal(self.columns(m), self.shared) for m in range(len(self.alignment.models)))

    def own(self, m: int, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` of the texts' tokenizer as model ``m``'s ids of the same tokens (a token it lacks, padding
        only: every real one is shared, :func:`refuse_unshared`, as id 0, never attended to)."""
        table = torch.from_numpy(self.alignment.source_rows(str(m)).clip(min=0))
        return table[ids]

    def restrict(self, m: int, lp: torch.Tensor) -> torch.Tensor:
        """Model ``m``'s log-probabilities ``lp`` (positions, its rows) over the shared tokens, renormalised."""
        kept = lp[..., self.columns(m)]
        return kept - torch.logsumexp(kept, dim=-1, keepdim=True)

    def describe(self, roles: Sequence[str]) -> str:
        """One line for the report: how many tokens were shared of each vocabulary, matched how."""
        rows = ", ".join(f"the {role}'s {n:,}" for role, n in zip(roles, self.alignment.embed_rows))
        how = "by id (one extends the other)" if self.by_id else "by token string (the tokenizers differ)"
        return (f"{len(self.shared):,} tokens shared (of {rows}), matched {how}; KL and "
                "top-1 over the shared tokens, each model's log-probabilities renormalised over them; NLL over "
                "each model's own vocabulary")

    def to_json(self) -> dict[str, Any]:
        return {"alignment": self.alignment.to_json(), "reference": self.reference}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> SharedVocab:
        return SharedVocab(VocabAlignment.from_json(doc["alignment"]), int(doc["reference"]))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def own_batches(vocab: SharedVocab | None, m: int, batches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The padded ``batches`` (ids, mask) as model ``m`` reads them: its own ids of the same tokens."""
    return batches if vocab is None else [(vocab.own(m, ids), mask) for ids, mask in batches]


def model_rows(config: Mapping[str, Any]) -> int | None:
    """The rows of a model's vocabulary (its config's ``vocab_size``, or its text model's), None if not said."""
    for doc in (config, config.get("text_config") or {}):
        rows = doc.get("vocab_size") if isinstance(doc, dict) else None
        if isinstance(rows, int) and rows > 0:
            return rows
    return None


def same_vocabularies(directories: Sequence[Path], rows: Sequence[int | None]) -> bool:
    """Whether the models' vocabularies are one without reading a tokenizer: the same row count, and the same
    tokenizer files (or none)."""
    if len(set(rows)) > 1:
        return False
    found = [_tokenizer_bytes(d) for d in directories]
    present = [f for f in found if f]
    return all(f == present[0] for f in present)


def shared_vocab(directories: Sequence[Path], rows: Sequence[int | None], load: Any) -> tuple[Any, SharedVocab | None]:
    """The tokenizer that cuts the texts and how the vocabularies meet (None: they are one). ``load(directory)``
    loads a folder's tokenizer (None where it has none)."""
    tokenizers = [load(d) for d in directories]
    first = next((t for t in tokenizers if t is not None), None)
    if first is None:
        return None, None
    own = [t if t is not None else first for t in tokenizers]
    vocabs = [_vocab(t, r) for t, r in zip(own, rows)]
    if len(set(rows)) <= 1 and all(v == vocabs[0] for v in vocabs):
        return first, None
    held = [set(v) for v in vocabs]
    reference = next((i for i, v in enumerate(held) if tokenizers[i] is not None
                      and all(v <= other for other in held)), tokenizers.index(first))
    by_id: list[str | None] = [None] * (max(vocabs[reference].values(), default=-1) + 1)
    for token, i in vocabs[reference].items():
        by_id[i] = token
    gaps = [i for i, t in enumerate(by_id) if t is None]  # ids the texts' tokenizer gives no token: no one's
    tokens = tuple(t if t is not None else "" for t in by_id)
    sources = []
    for v, r in zip(vocabs, rows):
        found = source_rows(tokens, v, r if r is not None else len(tokens))
        found[gaps] = -1
        sources.append(found)
    alignment = VocabAlignment.from_arrays(models=tuple(str(i) for i in range(len(vocabs))), base=None,
                                           vocab_size=len(tokens), embed_rows=tuple(r or len(tokens) for r in rows),
                                           sources=tuple(sources), overrides=(), tokens=tokens)
    return own[reference], SharedVocab(alignment, reference)


def refuse_unshared(vocab: SharedVocab, tokens: Sequence[Sequence[int]], paths: Sequence[str],
                    where: Sequence[str]) -> None:
    """Refuse (exit 2, before any layer) a check its models cannot be compared in: no shared token, or a text
    (``where``: how the report names each, e.g. a prompts file's line) holding a token some model lacks."""
    shared = set(vocab.shared.tolist())
    if not shared:
        raise UsageError(f"{paths[0]} and {', '.join(paths[1:])} share no token: their vocabularies cannot be "
                         "compared", hint="check the merge against models of its own tokenizer")
    for text, ids in zip(where, tokens):
        lacking = next((i for i in ids if i not in shared), None)
        if lacking is None:
            continue
        token = dict(vocab.alignment.names).get(lacking, str(lacking))
        missing = [p for k, p in zip(vocab.alignment.models, paths) if vocab.alignment.source_rows(k)[lacking] < 0]
        raise UsageError(f"{text} holds the token {token!r}, which {', '.join(missing)} lacks: the models are "
                         f"compared over the {len(shared):,} tokens they share",
                         hint="leave that text out, or check the merge against models that hold the token")


def _vocab(tokenizer: Any, rows: int | None) -> dict[str, int]:
    """The tokenizer's tokens (added ones included) whose ids are below ``rows``."""
    return {token: i for token, i in tokenizer.get_vocab().items() if rows is None or i < rows}


def _tokenizer_bytes(directory: Path) -> tuple[bytes, ...]:
    found = []
    for name in TOKENIZER_FILES:
        try:
            found.append((directory / name).read_bytes())
        except OSError:
            found.append(b"")
    return tuple(found) if any(found) else ()
