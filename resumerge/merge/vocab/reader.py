"""Read one input model's tokenizer directory into a vocabulary limited to the rows its embedding matrix has.

Only ``tokenizer.json`` files of BPE tokenizers are read (and only small JSON files, never weights). A token whose
id is at or past the model's embedding rows has no embedding, so it is dropped, as mergekit's
``get_stripped_tokenizer`` does: from the model vocabulary, from ``added_tokens``, and from the merges that use
it. Unlike mergekit, a merge whose *result* was dropped goes too, because ``tokenizers`` refuses to load a merge
that produces a token outside the vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.errors import ModelInputError

TOKENIZER_FILE = "tokenizer.json"
# Files that show a directory has a tokenizer even when it has no tokenizer.json.
_OTHER_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "spiece.model")
# Files carried from the tokenizer the output is built on, besides tokenizer.json.
CARRIED_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class AddedToken:
    """One ``added_tokens`` entry of a tokenizer.json, with the settings ``tokenizers`` compares."""

    id: int
    content: str
    single_word: bool
    lstrip: bool
    rstrip: bool
    normalized: bool
    special: bool

    def settings(self) -> tuple[str, bool, bool, bool, bool, bool]:
        """Everything but the id: two entries with equal settings are the same added token."""
        return (self.content, self.single_word, self.lstrip, self.rstrip, self.normalized, self.special)

    def to_json(self) -> dict[str, Any]:
        """The entry as tokenizer.json writes it."""
        return {
            "id": self.id,
            "content": self.content,
            "single_word": self.single_word,
            "lstrip": self.lstrip,
            "rstrip": self.rstrip,
            "normalized": self.normalized,
            "special": self.special,
        }


@dataclass
class InputTokenizer:
    """A model's tokenizer after stripping. ``data`` is the parsed tokenizer.json (mutable: the builder extends it).

    ``vocab`` maps every kept token (model vocabulary and added tokens; an added token's id wins) to its id;
    ``added`` is the kept ``added_tokens`` in file order; ``dropped`` counts tokens removed for lack of a row;
    ``raw`` is the original tokenizer.json and ``files`` the other carried files (name -> bytes).
    """

    key: str
    directory: Path
    rows: int
    data: dict[str, Any]
    vocab: dict[str, int]
    added: list[AddedToken]
    dropped: int
    raw: bytes
    files: dict[str, bytes]


def read_input_tokenizer(key: str, directory: Path, rows: int) -> InputTokenizer | None:
    """Read ``directory``'s tokenizer, keeping only ids below ``rows``; None if the directory has no tokenizer.

    Raises :class:`ModelInputError` for a tokenizer that is not a BPE ``tokenizer.json`` (mergekit: "only BPE is
    currently supported for tokenizer merge") or a malformed tokenizer.json.
    """
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        if any((directory / name).is_file() for name in _OTHER_TOKENIZER_FILES):
            raise ModelInputError(
                f"the tokenizer of {key} has no tokenizer.json: only BPE tokenizers can be merged",
                path=str(directory),
                hint="use a model with a fast (tokenizer.json) BPE tokenizer, or drop the tokenizer section",
            )
        return None
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelInputError(f"{path} is not valid JSON: {exc}", path=str(path)) from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise ModelInputError(f"{path} has no tokenizer model", path=str(path))
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise ModelInputError(
            f"the tokenizer of {key} is a {kind} tokenizer: only BPE tokenizers can be merged",
            path=str(path),
            hint="give the models one tokenizer first with resumerge tokensurgeon MODEL DONOR OUT",
        )
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(type(i) is int and i >= 0 for i in vocab.values()):
        raise ModelInputError(f"{path}: model.vocab must map tokens to non-negative ids", path=str(path))
    added = [_added_token(e, path) for e in data.get("added_tokens") or ()]
    names = set(vocab).union(a.content for a in added)
    if any(i >= rows for i in vocab.values()) or any(a.id >= rows for a in added):
        _strip(data, rows)
        vocab = data["model"]["vocab"]
        added = [a for a in added if a.id < rows]
    kept = dict(vocab)
    kept.update((a.content, a.id) for a in added)  # as in tokenizers' get_vocab: an added token's id wins
    files = {name: (directory / name).read_bytes() for name in CARRIED_FILES if (directory / name).is_file()}
    return InputTokenizer(key, directory, rows, data, kept, added, len(names) - len(kept), raw, files)


def _added_token(entry: Any, path: Path) -> AddedToken:
    if not isinstance(entry, dict) or type(entry.get("id")) is not int or not isinstance(entry.get("content"), str):
        raise ModelInputError(f"{path}: malformed added_tokens entry {entry!r}", path=str(path))
    special = bool(entry.get("special", False))
    return AddedToken(
        id=entry["id"],
        content=entry["content"],
        single_word=bool(entry.get("single_word", False)),
        lstrip=bool(entry.get("lstrip", False)),
        rstrip=bool(entry.get("rstrip", False)),
        normalized=bool(entry.get("normalized", not special)),
        special=special,
    )


def _strip(data: dict[str, Any], rows: int) -> None:
    """Remove every id at or past ``rows`` from a tokenizer.json in place, with each merge that uses or makes one."""
    model = data["model"]
    removed = {tok for tok, i in model["vocab"].items() if i >= rows}
    model["vocab"] = {tok: i for tok, i in model["vocab"].items() if i < rows}
    data["added_tokens"] = [e for e in data.get("added_tokens") or () if e["id"] < rows]
    prefix = model.get("continuing_subword_prefix") or ""
    kept = []
    for merge in model.get("merges") or ():
        if isinstance(merge, str) and merge.count(" ") == 1:
            left, right = merge.split(" ")
        elif isinstance(merge, list) and len(merge) == 2 and all(isinstance(p, str) for p in merge):
            left, right = merge
        else:
            raise ModelInputError(f"unexpected merge format {merge!r} in tokenizer.json")
        made = left + (right[len(prefix) :] if prefix and right.startswith(prefix) else right)
        if left not in removed and right not in removed and made not in removed:
            kept.append(merge)
    model["merges"] = kept
