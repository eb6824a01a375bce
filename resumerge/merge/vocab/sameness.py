"""Whether two models share one tokenizer, in the one sense a merge with no ``tokenizer_source`` needs: each
embedding row means the same token in both.

Two tokenizers are *the same* here when every id both vocabularies hold is the same token string, leaving out the
ids where either holds a special token (``added_tokens`` marked ``special`` in tokenizer.json; GGUF control,
user-defined and unused tokens). So files that differ only in what does not change a row's meaning merge: a chat
template, ``tokenizer_config.json``, special-token maps, the normalizer or pre-tokenizer, the merges list, JSON
layout, and a chat fine-tune's renamed reserved slot (``<|reserved_special_token_3|>`` made ``<|im_start|>``), whose
rows no ordinary text reads. Ids only one model holds (tokens added in the other's padding rows) are not compared:
the rows' count is compared by the tensors' shapes. A model without a readable token list (no tokenizer.json, a
SentencePiece model alone) is not compared.

May import: errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# GGUF's tokenizer.ggml.token_type values of tokens that are not text: CONTROL, USER_DEFINED, UNUSED.
_GGUF_SPECIAL_TYPES = frozenset({3, 4, 5})


@dataclass(frozen=True)
class TokenTable:
    """A vocabulary as rows see it: the token string at each id, and the ids of special tokens."""

    tokens: Mapping[int, str]
    special: frozenset[int]


@dataclass(frozen=True)
class Difference:
    """The first id (lowest) at which two vocabularies hold different ordinary tokens, and the two tokens."""

    id: int
    first: str
    second: str


def table_of_tokenizer_json(raw: bytes) -> TokenTable | None:
    """The token table of a tokenizer.json's bytes (its model's vocabulary, a map or Unigram's list, and its
    added tokens, whose id wins as in ``tokenizers``); None when it holds no vocabulary it can be read from."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    tokens: dict[int, str] = {}
    if isinstance(vocab, dict):
        tokens.update((i, t) for t, i in vocab.items() if type(i) is int)
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs, the id their place
        tokens.update((i, e[0]) for i, e in enumerate(vocab) if isinstance(e, list) and e and isinstance(e[0], str))
    else:
        return None
    special = set()
    for entry in data.get("added_tokens") or ():
        if isinstance(entry, dict) and type(entry.get("id")) is int and isinstance(entry.get("content"), str):
            tokens[entry["id"]] = entry["content"]
            if entry.get("special"):
                special.add(entry["id"])
    return TokenTable(tokens, frozenset(special))


def table_of_gguf(metadata: Mapping[str, Any]) -> TokenTable | None:
    """The token table of a GGUF's metadata (``tokenizer.ggml.tokens`` and ``token_type``); None without it."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return None
    types = metadata.get("tokenizer.ggml.token_type")
    kinds = [int(t) for t in types] if types is not None else []
    special = frozenset(i for i, t in enumerate(kinds) if t in _GGUF_SPECIAL_TYPES)
    return TokenTable(dict(enumerate(str(t) for t in tokens)), special)


def first_difference(first: TokenTable, second: TokenTable) -> Difference | None:
    """Where ``first`` and ``second`` are not the same tokenizer (see the module's doc), or None where they are."""
    if first.tokens == second.tokens:
        return None
    for i in sorted(first.tokens.keys() & second.tokens.keys()):
        if i in first.special or i in second.special:
            continue
        if first.tokens[i] != second.tokens[i]:
            return Difference(i, first.tokens[i], second.tokens[i])
    return None
