"""Which row of MODEL each of DONOR's tokens gets: matched exactly on normalized tokens, by bytes, by prefix, or
approximated — mergekit-tokensurgeon 0.1.5's rules, decided once at planning from the two tokenizers.

Normalization (mergekit's ``normalized_vocabulary``): a word-start prefix (``Ġ`` for GPT-2 style tokenizers, ``▁``
for SentencePiece ones unless ``Ġhello`` is in the vocabulary, ``Ġ`` for any other class) becomes a marker, and a
token equal to a value of the tokenizer's ``special_tokens_map`` becomes its role, so MODEL's ``</s>`` and DONOR's
``<|endoftext|>`` match as ``eos_token``. A byte match takes MODEL's ``<0xNN>`` for a one-character token (and the
reverse; ``<0xNN>`` read as ``check`` reads it: :func:`resumerge.forward.vocabs.byte_token`); a prefix match MODEL's
longest proper prefix (special tokens never, stopping at an all-whitespace one). These are mergekit's rules, kept for
its rows bit for bit: ``check`` matches two vocabularies by the bytes each token stands for instead
(:mod:`resumerge.forward.vocabs`), so a byte-level ``Ã©`` and a SentencePiece ``é``, which 0.1.5 approximates, are
one token there.

The one difference from 0.1.5: ``--prefix-match embed`` / ``--byte-match embed`` apply to the token embedding and
``lm_head`` to the head, as the choices say; 0.1.5 applies each to the other matrix (:func:`allowed`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.errors import ModelInputError
from resumerge.forward.vocabs import byte_token, byte_token_name

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
    """One tokenizer's normalized vocabulary (token -> id, by id, the last id of tokens that normalize alike kept)
    and the tokenizer itself (for subword pieces)."""

    ids: Mapping[Normalized, int]
    tokenizer: Any = field(compare=False, repr=False)


@dataclass(frozen=True)
class MatrixMatch:
    """How one matrix (``embed`` or ``lm_head``) of the output is made: ``rows`` of it; ``copies`` (output row,
    MODEL's row) of the tokens matched; ``approximated`` the output rows approximated, by DONOR id (the order batches
    cut); ``shared`` the (DONOR row, MODEL row) pairs of the tokens both hold, by DONOR id (the
    basis of omp, common_interpolation and landmark_pca); ``pieces`` MODEL's ids of each approximated token
    tokenized by MODEL (subword only); the counts of each kind of match."""

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

    def digest(self) -> str:
        """A digest of everything the matrix's rows follow from (the fingerprint holds it)."""
        text = json.dumps([self.rows, self.copies, self.approximated, self.shared, self.pieces, self.junk])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def report(self, by: str) -> str:
        """``900 shared (copied), 12 matched by prefix, 85 approximated by omp (k=64)`` (the log's, status's and the
        card's line; ``by``: the method)."""
        parts = [f"{self.exact} shared (copied)"]
        if self.byte:
            parts.append(f"{self.byte} matched by bytes")
        if self.prefix:
            parts.append(f"{self.prefix} matched by prefix")
        parts.append(f"{len(self.approximated)} approximated by {by}")
        if self.junk:
            parts.append(f"{len(self.junk)} under-trained in both models left zero")
        if self.dropped:
            parts.append(f"{self.dropped} past the matrix's rows left zero")
        return ", ".join(parts)


def load_vocabulary(directory: Path, *, what: str) -> Vocabulary:
    """The normalized vocabulary of the tokenizer in ``directory``; ModelInputError (exit 2) when there is none."""
    from resumerge.inputs.files import tokenizer_files

    if not tokenizer_files(directory):
        raise ModelInputError(f"{what} has no tokenizer (no tokenizer.json or tokenizer_config.json in "
                              f"{directory})", path=str(directory),
                              hint=f"give a {what} folder or repo that ships its tokenizer files")
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise ModelInputError(f"{what}'s tokenizer cannot be loaded: {exc}", path=str(directory)) from None
    return Vocabulary(normalized(tokenizer), tokenizer)


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


def normalized(tokenizer: Any) -> dict[Normalized, int]:
    """``tokenizer``'s vocabulary normalized (see the module docstring)."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    prefix = word_start_prefix(tokenizer, vocab)
    specials: Mapping[str, Any] = tokenizer.special_tokens_map
    # By id: get_vocab()'s order follows a hash map's (another in each process), and the order decides which token
    # of several that normalize alike is kept and which batch each approximated token falls in.
    return {normalize(token, specials, prefix): i for token, i in sorted(vocab.items(), key=lambda item: item[1])}


def normalize(token: str, specials: Mapping[str, Any], prefix: str) -> Normalized:
    """One token normalized: the word-start marker first, then the first special role it fills."""
    if token.startswith(prefix):
        return (_WORD_START, token[len(prefix):])
    for role, values in specials.items():
        if token in ([values] if isinstance(values, str) else values):
            return (_SPECIAL, role)
    return token


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
    safe_donor = {t: i for t, i in donor.ids.items() if i < donor_rows}
    rows = max(len(donor.ids), max(donor.ids.values(), default=-1) + 1)
    if cap:
        rows = min(rows, donor_rows)
    copies: list[tuple[int, int]] = []
    approximated: list[int] = []
    tokens: list[Normalized] = []
    exact = byte = prefix = dropped = 0
    use_byte, use_prefix = allowed(choices.byte_match, matrix), allowed(choices.prefix_match, matrix)
    for token, donor_id in donor.ids.items():
        if donor_id >= donor_rows:
            dropped += 1
            continue
        if token in orig:
            copies.append((donor_id, orig[token]))
            exact += 1
        elif use_byte and (found := _byte_twin(token, orig)) is not None:
            copies.append((donor_id, found))
            byte += 1
        elif use_prefix and (found := _longest_prefix(token, orig)) is not None:
            copies.append((donor_id, found))
            prefix += 1
        else:
            approximated.append(donor_id)
            tokens.append(token)
    shared = sorted(set(orig) & set(safe_donor), key=lambda t: safe_donor[t])
    split: tuple[tuple[int, ...], ...] = ()
    if choices.approximation_method == "subword":
        split = tuple(tuple(model.tokenizer(text_of(t), add_special_tokens=False)["input_ids"]) for t in tokens)
    return MatrixMatch(rows, tuple(copies), tuple(approximated), tuple((safe_donor[t], orig[t]) for t in shared),
                       split, tuple(sorted({j for j in junk if j < rows})), exact, byte, prefix, dropped)


def _byte_twin(token: Normalized, orig: Mapping[Normalized, int]) -> int | None:
    if not isinstance(token, str):
        return None
    if len(token) == 1 and ord(token) < 256:
        return orig.get(byte_token_name(ord(token)))
    byte = byte_token(token)
    return orig.get(chr(byte)) if byte is not None else None


def _prefixes(token: Normalized) -> Iterator[Normalized]:
    marker, text = token if isinstance(token, tuple) else (None, token)
    if marker == _SPECIAL:
        return
    for end in range(len(text) - 1, 0, -1):
        head = text[:end]
        if not head.strip():
            return
        yield (marker, head) if marker is not None else head


def _longest_prefix(token: Normalized, orig: Mapping[Normalized, int]) -> int | None:
    return next((orig[p] for p in _prefixes(token) if p in orig), None)
