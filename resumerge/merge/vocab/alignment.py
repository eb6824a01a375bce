"""How each input model's vocabulary rows map onto the output vocabulary: frozen, compact, serialisable data.

For every input model, ``source_rows(key)`` is an int64 array over the output's real vocabulary: the row of that
model's embedding matrix holding the token, or -1 when the model lacks it. A small table of
:class:`TokenOverride` records the ``tokenizer.tokens`` entries that name a row source. The fill rules that turn
this into aligned matrices live in :mod:`resumerge.merge.vocab.permute`; they depend on which models a tensor is merged
from, so the alignment keeps every input and the rules run per tensor.

Source arrays are stored as run-length encoded ``(start, length, first_source_row)`` triples, so an alignment is
a few hundred bytes when vocabularies agree and stays hashable; :meth:`VocabAlignment.to_json` and
:meth:`VocabAlignment.digest` cover all of it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from resumerge.errors import ConfigError

Runs = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class TokenOverride:
    """A configured row source for one output token (from ``tokenizer.tokens``).

    ``model`` None means a row of zeros; otherwise the row is ``row`` of ``model``'s matrix. ``force`` applies the
    row to every model, not only to models lacking the token.
    """

    token_id: int
    token: str
    force: bool
    model: str | None
    row: int
    yaml_path: str


@dataclass(frozen=True)
class MissingToken:
    """An output token that none of a tensor's input models has: its rows are zeros."""

    token_id: int
    token: str

    def message(self) -> str:
        """mergekit's warning for the same situation."""
        return f"Token {self.token!r} not found in any model"


@dataclass(frozen=True)
class VocabAlignment:
    """The per-model source rows of an output vocabulary, and everything the fill rules need.

    ``models``: input keys, in input order. ``base``: the configured base model (rule 1 of the fill order), or None.
    ``real_size``: tokens in the output vocabulary. ``vocab_size``: output rows after padding (``>= real_size``;
    padding rows get the mean of the real rows). ``embed_rows``: rows of each model's input matrix.
    ``runs``: each model's source rows, run-length encoded. ``overrides``: configured row sources, by token id.
    ``names``: (token id, text) of every token some input lacks, for reports.
    """

    models: tuple[str, ...]
    base: str | None
    real_size: int
    vocab_size: int
    embed_rows: tuple[int, ...]
    runs: tuple[Runs, ...]
    overrides: tuple[TokenOverride, ...] = ()
    names: tuple[tuple[int, str], ...] = field(default=(), repr=False)

    @classmethod
    def from_arrays(
        cls,
        *,
        models: tuple[str, ...],
        base: str | None,
        vocab_size: int,
        embed_rows: tuple[int, ...],
        sources: tuple[npt.NDArray[np.int64], ...],
        overrides: tuple[TokenOverride, ...],
        tokens: tuple[str, ...],
    ) -> VocabAlignment:
        """Build an alignment from dense source arrays (one per model, length = real vocabulary size).

        ``tokens`` is the output vocabulary by id; only the names of tokens some model lacks are kept.
        """
        real_size = len(tokens)
        if any(a.shape != (real_size,) for a in sources):
            raise ValueError("every source array must have one entry per output token")
        lacking = np.zeros(real_size, dtype=bool)
        for array in sources:
            lacking |= array < 0
        names = tuple((int(i), tokens[int(i)]) for i in np.flatnonzero(lacking))
        return cls(
            models=models,
            base=base,
            real_size=real_size,
            vocab_size=vocab_size,
            embed_rows=embed_rows,
            runs=tuple(_encode_runs(a) for a in sources),
            overrides=tuple(sorted(overrides, key=lambda o: o.token_id)),
            names=names,
        )

    def source_rows(self, key: str) -> npt.NDArray[np.int64]:
        """The source row of every output token in ``key``'s matrix (-1: the model lacks the token). Read-only."""
        return self._decoded[self.models.index(key)]

    @cached_property
    def _decoded(self) -> tuple[npt.NDArray[np.int64], ...]:
        arrays = []
        for runs in self.runs:
            array = _decode_runs(runs, self.real_size)
            array.flags.writeable = False
            arrays.append(array)
        return tuple(arrays)

    def to_json(self) -> str:
        """Canonical JSON of the whole alignment (sorted keys, no whitespace); :meth:`from_json` reverses it."""
        doc: dict[str, Any] = {
            "models": list(self.models),
            "base": self.base,
            "real_size": self.real_size,
            "vocab_size": self.vocab_size,
            "embed_rows": list(self.embed_rows),
            "runs": [[list(r) for r in runs] for runs in self.runs],
            "overrides": [
                {
                    "token_id": o.token_id,
                    "token": o.token,
                    "force": o.force,
                    "model": o.model,
                    "row": o.row,
                    "yaml_path": o.yaml_path,
                }
                for o in self.overrides
            ],
            "names": [[i, t] for i, t in self.names],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    @classmethod
    def from_json(cls, text: str) -> VocabAlignment:
        """Rebuild an alignment from :meth:`to_json` output."""
        doc = json.loads(text)
        return cls(
            models=tuple(doc["models"]),
            base=doc["base"],
            real_size=doc["real_size"],
            vocab_size=doc["vocab_size"],
            embed_rows=tuple(doc["embed_rows"]),
            runs=tuple(tuple((s, n, r) for s, n, r in runs) for runs in doc["runs"]),
            overrides=tuple(TokenOverride(**o) for o in doc["overrides"]),
            names=tuple((i, t) for i, t in doc["names"]),
        )

    def digest(self) -> str:
        """sha256 (hex) of :meth:`to_json`: equal digests mean equal alignments."""
        return hashlib.sha256(self.to_json().encode("ascii")).hexdigest()


def check_keys(alignment: VocabAlignment, keys: Sequence[str]) -> None:
    """Check that a tensor merged from ``keys`` can be aligned; call it at planning time to fail early.

    Raises ``ValueError`` for keys the alignment does not know or repeats, and :class:`ConfigError` (at the
    token's ``yaml_path``) when a configured row source is a model that is not among ``keys`` while some model of
    ``keys`` lacks the token or the entry is forced (mergekit: "Token ... requires a vocabulary weight from model
    ..., but that weight is missing").
    """
    unknown = [k for k in keys if k not in alignment.models]
    if unknown:
        raise ValueError(f"model {unknown[0]!r} is not an input of this vocabulary alignment")
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate model keys {list(keys)!r}")
    for override in alignment.overrides:
        if override.model is None or override.model in keys:
            continue
        needed = override.force or any(alignment.source_rows(k)[override.token_id] < 0 for k in keys)
        if needed:
            raise ConfigError(
                f"Token {override.token!r} requires a vocabulary weight from model {override.model}, "
                "but that model is not merged into this tensor",
                yaml_path=f"{override.yaml_path}.source",
            )


def missing_rows_report(alignment: VocabAlignment, keys: Sequence[str]) -> tuple[MissingToken, ...]:
    """Tokens that none of ``keys`` has and no ``tokens:`` entry configures: their rows come out as zeros.

    This is the data behind mergekit's warning ``Token ... not found in any model``; nothing is printed.
    """
    check_keys(alignment, keys)
    configured = {o.token_id for o in alignment.overrides}
    missing = []
    for token_id, token in alignment.names:
        if token_id not in configured and all(alignment.source_rows(k)[token_id] < 0 for k in keys):
            missing.append(MissingToken(token_id, token))
    return tuple(missing)


def _encode_runs(array: npt.NDArray[np.int64]) -> Runs:
    """Runs of consecutive output ids whose source rows are consecutive too (or all -1)."""
    if array.size == 0:
        return ()
    values = array.astype(np.int64)
    # A run continues while the source row grows by one, or while both rows are -1.
    step = np.diff(values)
    continues = ((step == 1) & (values[:-1] >= 0)) | ((values[:-1] < 0) & (values[1:] < 0))
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    ends = np.concatenate((starts[1:], [values.size]))
    return tuple((int(s), int(e - s), int(values[s])) for s, e in zip(starts, ends))


def _decode_runs(runs: Runs, size: int) -> npt.NDArray[np.int64]:
    array = np.full(size, -1, dtype=np.int64)
    for start, length, first in runs:
        if first >= 0:
            array[start : start + length] = np.arange(first, first + length, dtype=np.int64)
    return array
