"""Which row of MODEL each of DONOR's tokens gets: matched on the bytes each token stands for, by bytes (``<0xNN>``),
by prefix, or approximated — mergekit-tokensurgeon 0.1.5's rules where the two tokenizers write bytes alike, decided
once at planning from the two tokenizers.

Tokens are one when they stand for the same bytes, read as ``check`` reads them
(:func:`resumerge.forward.text.vocabs.spelled`: GPT-2's byte map, SentencePiece's ``▁`` and ``<0xNN>``, an added token
by its content), or when they fill the same special role. 0.1.5 matches token *strings* (normalized, below), which
across tokenizer families is wrong both ways: a byte-level ``Ã©`` and a SentencePiece ``é`` (or ``ĠĠ`` and
``▁▁``, or ``Ċ`` and ``<0x0A>``) are one token it approximates, and a byte-level ``¡`` (the byte A1) or ``Ċ`` (a
newline) is another token than a SentencePiece ``¡`` (C2 A1) or ``Ċ`` (C4 8A), whose row it copies. Each matrix's
match counts both (:attr:`MatrixMatch.gained`, :attr:`MatrixMatch.mended`) for the log, ``status`` and the card.
Where the two tokenizers write a token's bytes alike the row is 0.1.5's, bit for bit.

Normalization (mergekit's ``normalized_vocabulary``, which decides 0.1.5's row and which of several tokens that
normalize alike is an output row at all): a word-start prefix (``Ġ`` for GPT-2 style tokenizers, ``▁`` for
SentencePiece ones unless ``Ġhello`` is in the vocabulary, ``Ġ`` for any other class) becomes a marker, and a
token equal to a value of the tokenizer's ``special_tokens_map`` becomes its role, so MODEL's ``</s>`` and DONOR's
``<|endoftext|>`` match as ``eos_token``. A byte match (``--byte-match``) takes MODEL's ``<0xNN>`` for a
one-character token (and the reverse; ``<0xNN>`` read by :func:`resumerge.forward.text.vocabs.byte_token`) where no
token of the same bytes is MODEL's; a prefix match (``--prefix-match``) MODEL's token of the longest proper prefix
of the token's bytes, cut where its characters are (special tokens never, stopping at an all-whitespace one).

The other difference from 0.1.5: ``--prefix-match embed`` / ``--byte-match embed`` apply to the token embedding and
``lm_head`` to the head, as the choices say; 0.1.5 applies each to the other matrix (:func:`allowed`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from resumerge.errors import ModelInputError
from resumerge.forward.text.vocabs import (
    Spelled,
    Spelling,
    byte_token,
    byte_token_name,
    special_key,
    spelled,
    spelling_of,
)

if TYPE_CHECKING:
    from resumerge.runs.transplant.spec import SurgeryChoices

# A normalized token: the text, or (marker, text) for a word start or a special role.
Normalized = str | tuple[str, str]
_WORD_START, _SPECIAL = "word_start", "special"
_GPT2_STYLE = ("GPT2Tokenizer", "GPT2TokenizerFast", "OpenAIGPTTokenizer", "OpenAIGPTTokenizerFast",
               "Qwen2Tokenizer", "Qwen2TokenizerFast")
_SP_STYLE = ("LlamaTokenizer", "LlamaTokenizerFast", "T5Tokenizer", "T5TokenizerFast", "GemmaTokenizer",
             "GemmaTokenizerFast")


@dataclass(frozen=True)
class Vocabulary:
    """One tokenizer's normalized vocabulary (token -> id, by id, the last id of tokens that normalize alike kept),
    its tokens by the bytes they stand for (``check``'s reading, :func:`~resumerge.forward.text.vocabs.spelled`), how it
    writes bytes, and the tokenizer itself (for subword pieces)."""

    ids: Mapping[Normalized, int]
    tokenizer: Any = field(compare=False, repr=False)
    spelled: Spelled = field(default_factory=lambda: Spelled({}, {}, {}), compare=False, repr=False)
    spelling: Spelling = field(default_factory=Spelling, compare=False)


@dataclass(frozen=True)
class MatrixMatch:
    """How one matrix (``embed`` or ``lm_head``) of the output is made: ``rows`` of it; ``copies`` (output row,
    MODEL's row) of the tokens matched; ``approximated`` the output rows approximated, by DONOR id (the order batches
    cut); ``shared`` the (DONOR row, MODEL row) pairs of the tokens both hold, by DONOR id (the
    basis of omp, common_interpolation and landmark_pca); ``pieces`` MODEL's ids of each approximated token
    tokenized by MODEL (subword only); the counts of each kind of match: ``exact`` the tokens both write alike,
    ``same_bytes`` those MODEL writes otherwise (``Ã©`` for ``é``), ``gained`` the tokens matched that 0.1.5
    approximates (or prefix-matches), ``mended`` those 0.1.5 copies from a row of other bytes."""

    rows: int
    copies: tuple[tuple[int, int], ...]
    approximated: tuple[int, ...]
    shared: tuple[tuple[int, int], ...]
    pieces: tuple[tuple[int, ...], ...] = ()
    # Rows zeroed last (--magikarp: DONOR tokens neither model trained well).
    junk: tuple[int, ...] = ()
    exact: int = 0
    byte: int = 0
    prefix: int = 0
    dropped: int = 0
    same_bytes: int = 0
    gained: int = 0
    mended: int = 0

    def digest(self) -> str:
        """A digest of everything the matrix's rows follow from (the fingerprint holds it)."""
        text = json.dumps([self.rows, self.copies, self.approximated, self.shared, self.pieces, self.junk])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def report(self, by: str) -> str:
        """``900 shared (copied), 12 matched by prefix, 85 approximated by omp (k=64)`` (the log's, status's and the
        card's line; ``by``: the method), and where 0.1.5's match by token string differs, by how much."""
        parts = [f"{self.exact + self.same_bytes} shared (copied)"]
        if self.same_bytes:
            parts[0] += f" of which {self.same_bytes} written otherwise by MODEL (the same bytes)"
        if self.byte:
            parts.append(f"{self.byte} matched by bytes")
        if self.prefix:
            parts.append(f"{self.prefix} matched by prefix")
        parts.append(f"{len(self.approximated)} approximated by {by}")
        if self.junk:
            parts.append(f"{len(self.junk)} under-trained in both models left zero")
        if self.dropped:
            parts.append(f"{self.dropped} past the matrix's rows left zero")
        if self.gained or self.mended:
            parts.append(f"matched by the bytes each token stands for: mergekit-tokensurgeon 0.1.5 (by token string) "
                         f"would approximate {self.gained} of the tokens copied here and copy {self.mended} from "
                         "another token's row")
        return ", ".join(parts)


def load_vocabulary(directory: Path, *, what: str, direct: bool = True) -> Vocabulary:
    """The normalized vocabulary of the tokenizer in ``directory``; ModelInputError (exit 2) when there is none.
    ``direct``: read tokenizer.json with the ``tokenizers`` library where transformers would build that same
    tokenizer (:func:`direct_vocabulary`); False where the tokenizer must also cut texts as transformers' does (the
    ``subword`` approximation cuts each approximated token into MODEL's pieces)."""
    if not any((directory / name).is_file() for name in _VOCABULARY_FILES):
        # A tokenizer_config.json alone names a class with no vocabulary to build it from (transformers then
        # fails in five lines asking for sentencepiece, or builds a tokenizer of the special tokens alone).
        raise ModelInputError(f"{what} has no tokenizer files: none of {', '.join(_VOCABULARY_FILES)} in "
                              f"{directory}", path=str(directory),
                              hint=f"give a {what} folder or repo that ships its tokenizer files")
    found = direct_vocabulary(directory) if direct else None
    if found is not None:
        return found
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, ImportError) as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ModelInputError(f"{what}'s tokenizer cannot be loaded: {first}", path=str(directory)) from None
    return vocabulary_of(tokenizer)


# The files a tokenizer's vocabulary is read from (one at least), among those an output copies.
_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def vocabulary_of(tokenizer: Any) -> Vocabulary:
    """The :class:`Vocabulary` of a loaded tokenizer."""
    vocab: dict[str, int] = tokenizer.get_vocab()  # once: 262,144 tokens cross from Rust for each call
    return Vocabulary(normalized(tokenizer, vocab), tokenizer, spelled(tokenizer, None, vocab), spelling_of(tokenizer))


def direct_vocabulary(directory: Path) -> Vocabulary | None:
    """The :class:`Vocabulary` of ``directory``'s tokenizer.json read with the ``tokenizers`` library alone, where
    transformers 5 would give the same one; None where it might not (the caller loads it with transformers).

    Loading Gemma 3's tokenizer through transformers' ``GemmaTokenizer`` costs ~4.3 CPU s (it parses the 33 MB
    tokenizer.json in Python and rebuilds its backend), the ``tokenizers`` library reads it in ~1 s: the same tokens,
    added tokens and pipeline (tests/transplant/test_direct.py compares both paths' vocabularies and matches). What
    transformers adds is the special roles (0.1.5 matches specials by role), and those are read here from the configs
    as transformers fills them: tokenizer_config.json's named tokens, else the class's defaults
    (:data:`_DIRECT_CLASSES`). Transformers is used instead where: there is no tokenizer.json or
    tokenizer_config.json; the class is another (its rebuild may change the pipeline or add tokens: Llama's and
    GPT-2's set their own pre-tokenizer and decoder); the config has a key that may change the tokens (anything
    but :data:`~resumerge.forward.text.plaintok._INERT`'s) or extra special tokens (a mapping of them makes more roles);
    a special token the configs or the class's defaults name is not an added special token of tokenizer.json with
    the settings transformers gives it (it would add it: another token, another id), or special_tokens_map.json
    names another; tokenizer.json sets padding or truncation. Over 100,000 tokens transformers may patch a Mistral
    model's pre-tokenizer regex: a ``Split`` step, which no byte form reads (:func:`spelling_of`)."""
    from resumerge.forward.text.plaintok import _INERT, NAMED_TOKENS, PlainTokenizer, _special, _specials, json_object

    config = json_object(directory / "tokenizer_config.json")
    if config is None or not set(config) <= _INERT:
        return None
    defaults = _DIRECT_CLASSES.get(str(config.get("tokenizer_class")))
    if defaults is None or any(config.get(key) is not None for key in ("extra_special_tokens",
                                                                      "additional_special_tokens")):
        return None
    try:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception:  # tokenizers raises a bare Exception for a file it cannot read: transformers says why
        return None
    if backend.padding is not None or backend.truncation is not None:
        return None
    # tokenizer.json's added tokens as its entries write them, from the loaded backend (parsing the 33 MB file again
    # in Python would cost a second of what this saves)
    added = {str(t.content): {"id": int(i), "content": str(t.content), "single_word": t.single_word,
                              "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                              "special": t.special} for i, t in backend.get_added_tokens_decoder().items()}
    named = _specials(directory, config, added)
    if named is None:
        return None
    for key, value in defaults.items():
        if key in config:  # named (or set to null) by the config: the default is not used
            continue
        content = _special(value, added)
        if content is None:
            return None
        named[key] = content
    # In transformers' order of roles: a token filling two (SmolLM2's pad and eos) takes the first.
    roles = special_roles({key: named[key] for key in NAMED_TOKENS if key in named})
    tokenizer = PlainTokenizer(backend, None, named)
    vocab = tokenizer.get_vocab()
    prefix = _prefix_of_class(str(config["tokenizer_class"]), vocab)
    ids = {normalize(token, roles, prefix): i for token, i in sorted(vocab.items(), key=lambda item: item[1])}
    return Vocabulary(ids, tokenizer, spelled(tokenizer, None, vocab), spelling_of(tokenizer))


# tokenizer_config.json classes transformers 5 builds from tokenizer.json unchanged, each with the special roles its
# __init__ fills by default (where the config names none); a test holds these against transformers' own.
_DIRECT_CLASSES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "TokenizersBackend": MappingProxyType({}),
    "PreTrainedTokenizerFast": MappingProxyType({}),
    "GemmaTokenizer": MappingProxyType({"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>",
                                        "pad_token": "<pad>", "mask_token": "<mask>"}),
})


def _prefix_of_class(name: str, vocab: Mapping[str, int]) -> str:
    """:func:`word_start_prefix` of a tokenizer of the class ``name`` (one of :data:`_DIRECT_CLASSES`), without
    loading it."""
    if name in _GPT2_STYLE:
        return "Ġ"
    if name in _SP_STYLE:
        return "Ġ" if "Ġhello" in vocab else "▁"
    return "Ġ"


def word_start_prefix(tokenizer: Any, vocab: Mapping[str, int]) -> str:
    """The word-start marker of ``tokenizer``'s tokens, by its class as mergekit tells it."""
    import transformers

    def of(names: tuple[str, ...]) -> tuple[type, ...]:
        return tuple(c for c in (getattr(transformers, n, None) for n in names) if isinstance(c, type))

    if isinstance(tokenizer, of(_GPT2_STYLE)):
        return "Ġ"
    if isinstance(tokenizer, of(_SP_STYLE)):
        return "Ġ" if "Ġhello" in vocab else "▁"
    return "Ġ"


def normalized(tokenizer: Any, vocab: Mapping[str, int] | None = None) -> dict[Normalized, int]:
    """``tokenizer``'s vocabulary (``vocab``: its ``get_vocab()``, read here where not given) normalized (see the
    module docstring)."""
    if vocab is None:
        vocab = tokenizer.get_vocab()
    prefix = word_start_prefix(tokenizer, vocab)
    roles = special_roles(tokenizer.special_tokens_map)
    # By id: get_vocab()'s order follows a hash map's (another in each process), and the order decides which token
    # of several that normalize alike is kept and which batch each approximated token falls in.
    return {normalize(token, roles, prefix): i for token, i in sorted(vocab.items(), key=lambda item: item[1])}


def special_roles(specials: Mapping[str, Any]) -> dict[str, str]:
    """``special_tokens_map`` as token -> the first role it fills (a dict lookup per token, not a scan of roles)."""
    roles: dict[str, str] = {}
    for role, values in specials.items():
        for value in [values] if isinstance(values, str) else values:
            roles.setdefault(value, role)
    return roles


def normalize(token: str, roles: Mapping[str, str], prefix: str) -> Normalized:
    """One token normalized: the word-start marker first, then the first special role it fills (``roles``:
    :func:`special_roles`)."""
    if token.startswith(prefix):
        return (_WORD_START, token[len(prefix):])
    role = roles.get(token)
    return (_SPECIAL, role) if role is not None else token


def text_of(token: Normalized) -> str:
    """The text a normalized token stands for (a word start as a leading space), as MODEL's tokenizer reads it."""
    if isinstance(token, tuple):
        return " " + token[1] if token[0] == _WORD_START else token[1]
    return token


def allowed(choice: str, matrix: str) -> bool:
    """Whether a match of ``choice`` (yes, no, embed, lm_head) applies to ``matrix`` (embed or lm_head)."""
    return choice == "yes" or choice == matrix


def match_matrix(model: Vocabulary, donor: Vocabulary, model_rows: int, donor_rows: int, *, matrix: str,
                 choices: SurgeryChoices, trained: set[Normalized] | None = None, junk: tuple[int, ...] = (),
                 cap: bool = False) -> MatrixMatch:
    """The match of one matrix (``embed`` or ``lm_head``) of ``model_rows`` rows in MODEL and ``donor_rows`` in
    DONOR, as the transplant's ``choices`` say (``prefix_match``, ``byte_match``, and whether each approximated
    token is split into MODEL's pieces: the ``subword`` approximation); ``trained``: the tokens MODEL may lend its
    rows for (--magikarp; None: all), ``junk`` the rows zeroed last; ``cap``: the output has DONOR's rows, not its
    tokenizer's size (a GGUF output of a GGUF DONOR holds the file's own vocabulary)."""
    orig = {t: i for t, i in model.ids.items() if i < model_rows and (trained is None or t in trained)}
    lends = set(orig.values())
    # MODEL's row of each run of bytes, among the rows it may lend.
    held = {key: i for key, i in model.spelled.ids.items() if i in lends}
    mine, theirs = model.spelled.keys, donor.spelled.keys
    rows = max(len(donor.ids), max(donor.ids.values(), default=-1) + 1)
    if cap:
        rows = min(rows, donor_rows)
    copies: list[tuple[int, int]] = []
    shared: list[tuple[int, int]] = []
    approximated: list[int] = []
    tokens: list[tuple[Normalized, int]] = []
    exact = same_bytes = byte = prefix = dropped = gained = mended = 0
    use_byte, use_prefix = allowed(choices.byte_match, matrix), allowed(choices.prefix_match, matrix)
    for token, donor_id in donor.ids.items():
        if donor_id >= donor_rows:
            dropped += 1
            continue
        key = theirs.get(donor_id)
        # 0.1.5's row: the token of the same normalized string, else its byte twin (it approximates the rest).
        string_row = orig.get(token)
        if string_row is None and use_byte:
            string_row = _byte_twin(token, orig)
        found: int | None
        if token in orig and (_is_special(token) or mine.get(orig[token]) == key):
            found = orig[token]
            exact += 1
        elif key is not None and (found := held.get(key)) is not None:
            same_bytes += 1
        else:
            found = None
        if found is not None:
            copies.append((donor_id, found))
            shared.append((donor_id, found))
            if string_row is None:
                gained += 1
        elif use_byte and (found := _byte_twin(token, orig)) is not None:
            copies.append((donor_id, found))
            byte += 1
        elif use_prefix and (found := _longest_prefix(token, key, held)) is not None:
            copies.append((donor_id, found))
            prefix += 1
        else:
            approximated.append(donor_id)
            tokens.append((token, donor_id))
        if string_row is not None and string_row != found:
            mended += 1
    split: tuple[tuple[int, ...], ...] = ()
    if choices.approximation_method == "subword":
        split = tuple(tuple(model.tokenizer(_text(t, theirs.get(i), donor.spelling), add_special_tokens=False)
                            ["input_ids"]) for t, i in tokens)
    return MatrixMatch(rows, tuple(copies), tuple(approximated), tuple(shared), split,
                       tuple(sorted({j for j in junk if j < rows})), exact, byte, prefix, dropped, same_bytes, gained,
                       mended)


def _is_special(token: Normalized) -> bool:
    return isinstance(token, tuple) and token[0] == _SPECIAL


def _text(token: Normalized, key: str | None, spelling: Spelling) -> str:
    """The text an approximated token is cut into MODEL's pieces from (subword): the bytes it stands for where its
    tokenizer writes bytes its own way (byte-level BPE, SentencePiece's byte tokens) and they are UTF-8 text, else
    0.1.5's reading of the normalized token."""
    if key is not None and not _is_special(token) and (spelling.byte_level or spelling.byte_fallback):
        try:
            return key.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass
    return text_of(token)


def _byte_twin(token: Normalized, orig: Mapping[Normalized, int]) -> int | None:
    if not isinstance(token, str):
        return None
    if len(token) == 1 and ord(token) < 256:
        return orig.get(byte_token_name(ord(token)))
    byte = byte_token(token)
    return orig.get(chr(byte)) if byte is not None else None


def _prefixes(token: Normalized, key: str) -> Iterator[str]:
    """The proper prefixes of a token's bytes (``key``, one character per byte), longest first, cut where the
    characters of its text end (every byte where they are no UTF-8 text), and never the word-start space alone nor
    any all-whitespace one (where 0.1.5 stops)."""
    if _is_special(token) or special_key(key):
        return
    raw = key.encode("latin-1")
    try:
        text = raw.decode("utf-8")
        ends = [len(text[:n].encode("utf-8")) for n in range(len(text) - 1, 0, -1)]
    except UnicodeDecodeError:
        ends = list(range(len(raw) - 1, 0, -1))
    lead = 0  # the word-start marker's bytes: no prefix is the marker alone
    if isinstance(token, tuple) and token[0] == _WORD_START:
        text_bytes = token[1].encode("utf-8")
        lead = 1 if raw.startswith(b" ") else len(raw) - len(text_bytes) if raw.endswith(text_bytes) else 0
    for end in ends:
        head = raw[:end]
        if not head[lead:].strip():
            return
        yield head.decode("latin-1")


def _longest_prefix(token: Normalized, key: str | None, held: Mapping[str, int]) -> int | None:
    if key is None:
        return None
    return next((held[p] for p in _prefixes(token, key) if p in held), None)
