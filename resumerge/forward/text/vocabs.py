"""Models whose vocabularies differ, compared over the tokens they share: decided from their tokenizers and
vocabulary sizes before any layer runs, kept with the check's token sequences and in its key (a resumed check
agrees with the one it resumes).

A ``tokenizer_source: union`` merge has more rows than its parents (49,280 against 49,152); a model fine-tuned
with added tokens, more than its base; a tokenizer transplant (``resumerge tokensurgeon``) has another family's
tokenizer than the MODEL it is checked against. Their log-probabilities are over different sets, and the check
compared them position by position as if they were one (a crash after the whole pass). The rule, one for every
figure:

* Where every model has the same number of rows and its tokens stand for the same bytes at the same ids (the same
  tokenizer, or none), nothing changes: the vocabularies are one, compared by id over every row.
* Otherwise each model's tokens are its tokenizer's (a model without one borrows the texts' tokenizer's), its ids
  below its own row count, each taken as **the bytes it stands for** (:func:`spelled`): a byte-level BPE token
  (GPT-2's byte map: SmolLM2, Llama 3, Qwen) through that map (``Ġthe`` is `` the``), a SentencePiece token
  (Gemma, Llama 2, Mistral) with its ``▁`` as a space (``▁the`` is `` the`` too) and a byte-fallback token
  ``<0xNN>`` as its byte, an added token as its content (a special one matches only a special one of the same
  content, or of the same named role: each model's BOS is one token), any other tokenizer's token as its text.
  Matched by token string, ``Ġthe`` and ``▁the`` were never one token and a SmolLM2-Gemma check shared almost
  nothing. The **shared tokens** are those every model holds
  (the same id everywhere where one vocabulary extends the other: "by id"). The texts are cut by the tokenizer of
  the first model (merge, base, parents) whose every token the others hold (a union merge's parent's: then every
  text token is shared), else the merge's; a text that holds a token some model lacks is refused in one line
  (exit 2), as is a check whose models share no token.
* Every model reads the texts as those tokens, each given as its own id of the same bytes (the hidden states
  stay comparable position by position; a model whose own tokenizer would cut a text otherwise reads it as cut
  for the others, and its NLL may be above what its own cut gives). Its NLL is over its whole vocabulary; KL
  and top-1 agreement are over the shared tokens only: each model's log-probabilities taken at the shared tokens
  and renormalised over them (``lp[S] - logsumexp(lp[S])``, the log-softmax of its logits restricted to S).

The mapping is :class:`resumerge.merge.vocab.VocabAlignment`, as a merge's tokenizer alignment is: over the texts'
tokenizer's tokens by id, each model's row of the same bytes (-1: it lacks them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from resumerge.errors import UsageError
from resumerge.machine.torch_import import torch
from resumerge.merge.vocab import VocabAlignment, source_rows

# How tokens of different vocabularies are matched, in the key of a check's kept token sequences (:mod:`.tokens`):
# kept under another rule (by token string, before issue 85's byte form) they are found again.
MATCHED_BY = "bytes, specials by role"
# The files that say a tokenizer's vocabulary (its template and settings aside).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _gpt2_byte_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it writes: the printable bytes (``!``-``~``,
    ``¡``-``¬``, ``®``-``ÿ``) stand for themselves, every other byte, in increasing order, for U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


BYTE_OF: Mapping[str, int] = MappingProxyType(_gpt2_byte_map())
# The byte map as str.translate takes it (a token straight to its key, below), and its characters.
_KEY_OF_CHAR: Mapping[int, str] = MappingProxyType({ord(c): chr(b) for c, b in BYTE_OF.items()})
_BYTE_CHARS = frozenset(BYTE_OF)
# A token's key is the bytes it stands for, written one character per byte (latin-1: every character below U+0100);
# a special token's is its content after this mark, which no bytes' key holds, so it matches only a special token.
_SPECIAL = "\uffff"
# After the special mark: a special token that fills a named role (``bos_token``) stands for the role (``roles``).
_ROLE = "\ufffd"
# The key of an id no token has (a gap in the texts' tokenizer's ids): no model's key, so no model holds it.
_NO_KEY = "\ufffe"


def byte_token(token: str) -> int | None:
    """The byte a byte-fallback token ``<0xNN>`` (SentencePiece's, for a byte no piece covers) stands for; None
    for any other token. The one reading of such tokens: the check's byte form (:func:`token_bytes`) and the
    transplant's ``--byte-match`` (:mod:`resumerge.runs.transplant.tokens`)."""
    if len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return None
    try:
        return int(token[3:5], 16)
    except ValueError:
        return None


def byte_token_name(byte: int) -> str:
    """The byte-fallback token of ``byte`` (``<0x0A>``), as SentencePiece vocabularies write it."""
    return f"<0x{byte:02X}>"


@dataclass(frozen=True)
class Spelling:
    """How a tokenizer's own (not added) tokens write the bytes they stand for: ``byte_level`` through GPT-2's
    byte map; else ``space`` (SentencePiece's ``▁``; None: none) is a space, and with ``byte_fallback`` a
    ``<0xNN>`` token its byte; anything else is its text, UTF-8."""

    byte_level: bool = False
    space: str | None = None
    byte_fallback: bool = False


def spelling_of(tokenizer: Any) -> Spelling:
    """The :class:`Spelling` of ``tokenizer`` (transformers', or :class:`~.plaintok.PlainTokenizer`), read from its
    ``tokenizers`` pipeline: what its decoder turns tokens into is what they stand for (a ``ByteLevel``
    decoder or pre-tokenizer: the byte map; a ``Metaspace`` one, or a ``Replace`` of ``▁`` by a space: SentencePiece's
    spaces; ``ByteFallback`` or the model's ``byte_fallback``: byte tokens). A tokenizer without that pipeline (a
    slow transformers one) is told by its SentencePiece model or its byte encoder."""
    backend = _backend(tokenizer)
    if backend is None:
        if getattr(tokenizer, "sp_model", None) is not None:
            return Spelling(space="▁", byte_fallback=True)
        return Spelling(byte_level=getattr(tokenizer, "byte_encoder", None) is not None)
    decoder, pre, normalizer = (list(_steps(_state(getattr(backend, name, None))))
                                for name in ("decoder", "pre_tokenizer", "normalizer"))
    byte_level = any(step.get("type") == "ByteLevel" for step in decoder + pre)
    space = next((found for step in decoder + pre + normalizer if (found := _space(step)) is not None), None)
    fallback = (any(step.get("type") == "ByteFallback" for step in decoder)
                or bool(getattr(getattr(backend, "model", None), "byte_fallback", False)))
    return Spelling(byte_level=byte_level, space=space, byte_fallback=fallback)


def token_bytes(token: str, spelling: Spelling) -> bytes:
    """The bytes a tokenizer's own token stands for (an added token stands for its content: :func:`spelled`)."""
    return _key(token, spelling).encode("latin-1")


def _key(token: str, spelling: Spelling) -> str:
    """:func:`token_bytes` as a key: one character per byte."""
    if spelling.byte_level:
        if _BYTE_CHARS.issuperset(token):
            return token.translate(_KEY_OF_CHAR)
        return token.encode("utf-8").decode("latin-1")  # not written in the byte map: its text
    if spelling.byte_fallback and (byte := byte_token(token)) is not None:
        return chr(byte)
    return (token.replace(spelling.space, " ") if spelling.space else token).encode("utf-8").decode("latin-1")


@dataclass(frozen=True)
class Spelled:
    """One tokenizer's tokens below its model's rows by the bytes they stand for: ``keys`` (id -> key, see
    :data:`_SPECIAL`), ``ids`` (key -> the one id taken for those bytes) and ``strings`` (id -> the token's
    string)."""

    keys: Mapping[int, str]
    ids: Mapping[str, int]
    strings: Mapping[int, str]


def spelled(tokenizer: Any, rows: int | None, vocab: Mapping[str, int] | None = None, *,
            roles: bool = False) -> Spelled:
    """``tokenizer``'s tokens (added ones included) whose ids are below ``rows``, by the bytes they stand for.

    Two tokens of one vocabulary may stand for the same bytes (SentencePiece's ``<0x41>`` and ``A``; an added token
    whose content is also another of the model's tokens). One id is taken for them, the one the tokenizer itself
    emits for those bytes: an added token before the model's own (added tokens are split off first), a model token
    before a byte-fallback one (a byte token is emitted only where no piece covers the byte), and of two alike the
    lowest id. The others still stand for those bytes (a text holding one is read by every model), but are no
    shared token of their own: two columns of one model's row would count its probability twice. ``vocab``: the
    tokenizer's ``get_vocab()`` where the caller has it already. ``roles``: a special token that fills a named role
    (``bos_token``, ``eos_token``, ``unk_token``, ...; the first it fills, in transformers' order) stands for that
    role, so two tokenizers' BOS are one token whatever each writes (the rule a transplant matches special tokens
    by: MODEL's ``<s>`` is DONOR's ``<|begin|>``)."""
    spelling = spelling_of(tokenizer)
    added = _added(tokenizer)
    role_of = _roles(tokenizer) if roles else {}
    keys: dict[int, str] = {}
    strings: dict[int, str] = {}
    best: dict[str, tuple[int, int]] = {}  # key -> (rank, id) of the id taken for it, the least
    fallback = spelling.byte_fallback
    for token, i in (vocab if vocab is not None else tokenizer.get_vocab()).items():
        if rows is not None and i >= rows:
            continue
        if i in added:
            content, special = added[i]
            role = role_of.get(content) if special else None
            rank, key = 0, (_SPECIAL + _ROLE + role if role is not None else _SPECIAL + content if special
                            else content.encode("utf-8").decode("latin-1"))
        elif fallback and (byte := byte_token(token)) is not None:
            # _key's reading of a byte token too, read once (a byte-level spelling writes bytes its own way)
            rank, key = 2, _key(token, spelling) if spelling.byte_level else chr(byte)
        else:
            rank, key = 1, _key(token, spelling)
        strings[i], keys[i] = token, key
        taken = best.get(key)
        if taken is None or (rank, i) < taken:
            best[key] = (rank, i)
    return Spelled(keys=keys, ids={key: i for key, (_, i) in best.items()}, strings=strings)


def _roles(tokenizer: Any) -> dict[str, str]:
    """``tokenizer``'s special tokens by content -> the first named role each fills (transformers'
    ``special_tokens_map``, or the plain tokenizer's named tokens), in :data:`~.plaintok.NAMED_TOKENS`' order."""
    from resumerge.forward.text.plaintok import NAMED_TOKENS

    named = getattr(tokenizer, "special_tokens_map", None) or getattr(tokenizer, "specials", None) or {}
    found: dict[str, str] = {}
    for role in NAMED_TOKENS:
        value = named.get(role)
        if isinstance(value, str) and value:
            found.setdefault(value, role)
    return found


def special_key(key: str) -> bool:
    """Whether ``key`` is a special token's (it matches only a special token's of the same content)."""
    return key.startswith(_SPECIAL)


def shown(key: str) -> str:
    """A key as the text it stands for (a refusal names the token by it: `` the``, not ``Ġthe``; a special role's
    as ``<bos_token>``)."""
    if key.startswith(_SPECIAL + _ROLE):
        return f"<{key[len(_SPECIAL + _ROLE):]}>"
    if special_key(key):
        return key[len(_SPECIAL):]
    return key.encode("latin-1").decode("utf-8", errors="backslashreplace")


@dataclass(frozen=True)
class SharedVocab:
    """How the models' different vocabularies meet (see the module's rule): ``alignment`` over the texts'
    tokenizer's tokens (``models`` are the indices of the check's models, as strings), ``reference`` the model whose
    tokenizer cut the texts, ``aliases`` its ids that stand for the same bytes as another of its tokens, taken for
    them (:func:`spelled`), ``same_strings`` how many of the shared tokens every model also writes as the same
    string (the count a match by token string found)."""

    alignment: VocabAlignment
    reference: int
    aliases: tuple[int, ...] = ()
    same_strings: int | None = None

    @cached_property
    def held(self) -> npt.NDArray[np.bool_]:
        """Over the texts' tokenizer's ids: whether every model holds the token's bytes (a text may hold it)."""
        held = np.ones(self.alignment.real_size, dtype=bool)
        for key in self.alignment.models:
            held &= self.alignment.source_rows(key) >= 0
        return held

    @cached_property
    def shared(self) -> torch.Tensor:
        """The texts' tokenizer's ids of the tokens every model holds, in id order (an alias left out: its bytes
        are another id's, each model's row of them once)."""
        held = self.held.copy()
        held[list(self.aliases)] = False
        return torch.from_numpy(np.flatnonzero(held).astype(np.int64))

    def columns(self, m: int) -> torch.Tensor:
        """Model ``m``'s ids of the shared tokens, in the order of :attr:`shared`."""
        return torch.from_numpy(self.alignment.source_rows(str(m))[self.shared.numpy()].copy())

    @property
    def by_id(self) -> bool:
        """Whether every model holds each shared token at the same id (one vocabulary extends the other)."""
        return all(torch.equal(self.columns(m), self.shared) for m in range(len(self.alignment.models)))

    def own(self, m: int, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` of the texts' tokenizer as model ``m``'s ids of the same bytes (a token it lacks, padding
        only: every real one is held, :func:`refuse_unshared`, as id 0, never attended to)."""
        table = torch.from_numpy(self.alignment.source_rows(str(m)).clip(min=0))
        return table[ids]

    def restrict(self, m: int, lp: torch.Tensor) -> torch.Tensor:
        """Model ``m``'s log-probabilities ``lp`` (positions, its rows) over the shared tokens, renormalised."""
        kept = lp[..., self.columns(m)]
        return kept - torch.logsumexp(kept, dim=-1, keepdim=True)

    def describe(self, roles: Sequence[str]) -> str:
        """One line for the report: how many tokens were shared of each vocabulary, matched how."""
        rows = ", ".join(f"the {role}'s {n:,}" for role, n in zip(roles, self.alignment.embed_rows))
        if self.by_id:
            how = "by id (one extends the other)"
        else:
            strings = f"{self.same_strings:,} of them by token string too; " if self.same_strings is not None else ""
            how = f"by the bytes they stand for ({strings}the tokenizers differ)"
        return (f"{len(self.shared):,} tokens shared (of {rows}), matched {how}; KL and "
                "top-1 over the shared tokens, each model's log-probabilities renormalised over them; NLL over "
                "each model's own vocabulary")

    def to_json(self) -> dict[str, Any]:
        return {"alignment": self.alignment.to_json(), "reference": self.reference, "aliases": list(self.aliases),
                "same_strings": self.same_strings}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> SharedVocab:
        same = doc.get("same_strings")
        return SharedVocab(VocabAlignment.from_json(doc["alignment"]), int(doc["reference"]),
                           tuple(int(i) for i in doc.get("aliases") or ()), int(same) if same is not None else None)

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
    vocabs = [spelled(t, r, roles=True) for t, r in zip(own, rows)]
    if len(set(rows)) <= 1 and all(v.keys == vocabs[0].keys for v in vocabs):
        return first, None
    held = [set(v.ids) for v in vocabs]
    reference = next((i for i, v in enumerate(held) if tokenizers[i] is not None
                      and all(v <= other for other in held)), tokenizers.index(first))
    mine = vocabs[reference]
    size = max(mine.keys, default=-1) + 1
    keys = tuple(mine.keys.get(i, _NO_KEY) for i in range(size))  # an id no token has: no one's
    sources = [source_rows(keys, v.ids, r if r is not None else size) for v, r in zip(vocabs, rows)]
    # The texts' tokenizer's model reads its own ids, an alias too (the others read their one id of its bytes).
    ids = np.arange(size, dtype=np.int64)
    sources[reference] = np.where(sources[reference] >= 0, ids, -1)
    aliases = tuple(i for i, key in mine.keys.items() if mine.ids[key] != i)
    names = tuple(shown(k) if k != _NO_KEY else "" for k in keys)
    alignment = VocabAlignment.from_arrays(models=tuple(str(i) for i in range(len(vocabs))), base=None,
                                           vocab_size=size, embed_rows=tuple(r or size for r in rows),
                                           sources=tuple(sources), overrides=(), tokens=names)
    found = SharedVocab(alignment, reference, aliases)
    same = sum(all(v.strings.get(int(j)) == mine.strings[int(i)] for v, j in zip(vocabs, row))
               for i, row in zip(found.shared.tolist(), _columns(found)))
    return own[reference], SharedVocab(alignment, reference, aliases, same)


def _columns(vocab: SharedVocab) -> Iterator[tuple[int, ...]]:
    """Each shared token's row in every model, in the order of :attr:`SharedVocab.shared`."""
    return zip(*(vocab.columns(m).tolist() for m in range(len(vocab.alignment.models))))


def refuse_unshared(vocab: SharedVocab, tokens: Sequence[Sequence[int]], paths: Sequence[str],
                    where: Sequence[str]) -> None:
    """Refuse (exit 2, before any layer) a check its models cannot be compared in: no shared token, or a text
    (``where``: how the report names each, e.g. a prompts file's line) holding a token some model lacks."""
    shared = len(vocab.shared)
    if not shared:
        raise UsageError(f"{paths[0]} and {', '.join(paths[1:])} share no token: their vocabularies cannot be "
                         "compared", hint="check the merge against models of its own tokenizer")
    held = vocab.held
    for text, ids in zip(where, tokens):
        lacking = next((i for i in ids if not held[i]), None)
        if lacking is None:
            continue
        token = dict(vocab.alignment.names).get(lacking, str(lacking))
        missing = [p for k, p in zip(vocab.alignment.models, paths) if vocab.alignment.source_rows(k)[lacking] < 0]
        raise UsageError(f"{text} holds the token {token!r}, which {', '.join(missing)} lacks: the models are "
                         f"compared over the {shared:,} tokens they share",
                         hint="leave that text out, or check the merge against models that hold the token")


def refuse_past_rows(tokenizer: Any, texts: Sequence[Any], rows: Sequence[int | None], paths: Sequence[str]) -> None:
    """Refuse (exit 2, before any layer) a text holding a token id past the models' rows (``rows``: their
    config's ``vocab_size``, None where not said): a tokenizer that numbers tokens the embedding and head lack,
    which torch would meet as an index error inside the first layer. ``texts``: :class:`~.texts.Text` (ids, where)."""
    known = [r for r in rows if r is not None]
    if not known:
        return
    limit = min(known)
    for text in texts:
        past = next((i for i in text.ids if i >= limit), None)
        if past is None:
            continue
        names = {i: t for t, i in tokenizer.get_vocab().items()} if hasattr(tokenizer, "get_vocab") else {}
        short = list(dict.fromkeys(p for p, r in zip(paths, rows) if r is not None and r <= past))
        raise UsageError(f"{text.where} holds the token {names.get(past, str(past))!r} (id {past:,}), past the "
                         f"{limit:,} rows of {', '.join(short)}: its tokenizer numbers tokens the model has no row "
                         "for", hint="leave that text out, or give the model a tokenizer that matches its "
                         "vocab_size")


def _backend(tokenizer: Any) -> Any:
    """``tokenizer``'s ``tokenizers.Tokenizer`` (transformers' fast tokenizers and the plain one have one), or
    None."""
    for name in ("backend_tokenizer", "backend"):
        found = getattr(tokenizer, name, None)
        if found is not None and hasattr(found, "get_added_tokens_decoder"):
            return found
    return None


def _added(tokenizer: Any) -> dict[int, tuple[str, bool]]:
    """The added tokens of ``tokenizer``: id -> (content, whether special). A non-special one that is also the
    model's own token at that id (a piece added again: Gemma 3's newline pieces) is left out:
    it stands for what the model's token does (``▁cat`` for `` cat``), not for its content as written."""
    backend = _backend(tokenizer)
    table = backend.get_added_tokens_decoder() if backend is not None else getattr(
        tokenizer, "added_tokens_decoder", None) or {}
    own: Mapping[str, int] = backend.get_vocab(with_added_tokens=False) if backend is not None else {}
    return {int(i): (str(t.content), bool(t.special)) for i, t in table.items()
            if t.special or own.get(str(t.content)) != int(i)}


def _state(component: Any) -> Any:
    """A ``tokenizers`` pipeline component (decoder, pre-tokenizer, normalizer) as its JSON, None where absent."""
    if component is None:
        return None
    try:
        return json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None


def _steps(doc: Any) -> Iterator[dict[str, Any]]:
    """A component's steps, a ``Sequence``'s flattened."""
    if not isinstance(doc, dict):
        return
    inner = doc.get("decoders") or doc.get("pretokenizers") or doc.get("normalizers")
    if doc.get("type") == "Sequence" and isinstance(inner, list):
        for each in inner:
            yield from _steps(each)
    else:
        yield doc


def _space(step: Mapping[str, Any]) -> str | None:
    """The character a step says stands for a space (``Metaspace``'s replacement, a ``Replace`` of it by a space
    or of a space by it), None where it says none."""
    if step.get("type") == "Metaspace":
        found = step.get("replacement")
        return found if isinstance(found, str) and found else None
    if step.get("type") == "Replace":
        pattern = (step.get("pattern") or {}).get("String")
        content = step.get("content")
        if content == " " and isinstance(pattern, str) and len(pattern) == 1:
            return pattern
        if pattern == " " and isinstance(content, str) and len(content) == 1:
            return content
    return None


def _tokenizer_bytes(directory: Path) -> tuple[bytes, ...]:
    found = []
    for name in TOKENIZER_FILES:
        try:
            found.append((directory / name).read_bytes())
        except OSError:
            found.append(b"")
    return tuple(found) if any(found) else ()
