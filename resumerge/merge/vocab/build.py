"""Build the output tokenizer of a merge and the row alignment of every input's vocabulary tensors.

Rules (mergekit 0.1.5 ``tokenizer/build.py``), applied to each input's tokenizer after dropping ids past its
embedding rows (:mod:`resumerge.merge.vocab.reader`):

* ``base``: the tokenizer of the base model (the first input when the config has none);
* a model key: that model's tokenizer;
* ``union``: the base tokenizer, then every other input's vocabulary tokens it lacks (each model's in id order,
  inputs in order; added as non-special, normalised added tokens, as mergekit's ``add_tokens(str)`` does), then
  every input's added tokens (the first definition of a token wins);
* finally each ``tokenizer.tokens`` key not yet present is appended.

Where mergekit leaves an order to a hash map (the ids of the union's vocabulary tokens) resumerge fixes it, so the
output is the same on every run. Files are produced as exact bytes: tokenizer.json is kept byte for byte when
nothing changed and re-serialised deterministically otherwise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from resumerge.errors import ConfigError, ModelInputError
from resumerge.merge.vocab.alignment import TokenOverride, VocabAlignment
from resumerge.merge.vocab.chat import (
    CONFIG_FILE,
    apply_chat_template_files,
    dump_json,
    load_json_object,
    resolve_chat_template,
)
from resumerge.merge.vocab.reader import TOKENIZER_FILE, AddedToken, InputTokenizer, read_input_tokenizer
from resumerge.merge.vocab.spec import TokenizerSpec

# What a new token gets when added by text (``tokenizers`` ``AddedToken::from(s, special=false)``).
_PLAIN = MappingProxyType({
    "single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False,
})
_MINIMAL_CONFIG = MappingProxyType({"tokenizer_class": "PreTrainedTokenizerFast"})


@dataclass(frozen=True)
class VocabInput:
    """One input model: its key, its directory (holding tokenizer files) and its embedding matrix's row count."""

    key: str
    directory: Path
    embed_rows: int


@dataclass(frozen=True)
class BuiltTokenizer:
    """The output tokenizer and how to align the inputs' vocabulary tensors to it.

    ``files``: (name, exact bytes), sorted by name. ``vocab_size``: rows of the output embedding / lm_head (after
    padding). ``alignment``: input for :func:`resumerge.merge.vocab.permute.align_rows`. ``digest``: sha256 over the
    files, vocab_size and alignment. ``chat_template``: the template text written, if any. ``warnings``: what
    mergekit would log (dropped tokens, conflicting added tokens, inputs without a tokenizer), as sentences.
    """

    files: tuple[tuple[str, bytes], ...] = field(repr=False)
    vocab_size: int
    alignment: VocabAlignment = field(repr=False)
    digest: str
    chat_template: str | None = field(default=None, repr=False)
    warnings: tuple[str, ...] = ()


@dataclass
class _Output:
    """The output tokenizer while it is assembled."""

    source: InputTokenizer
    vocab: dict[str, int]
    added: dict[int, AddedToken]
    changed: bool
    next_id: int = field(init=False)

    def __post_init__(self) -> None:
        self.next_id = max(self.vocab.values(), default=-1) + 1

    def add(self, token: AddedToken) -> None:
        """Add (or re-declare) an added token as ``tokenizers`` does: an identical one is ignored, an existing
        text keeps its id and takes the new settings, a new text gets the next id."""
        current = self.vocab.get(token.content)
        if current is not None and current in self.added and self.added[current].settings() == token.settings():
            return
        token_id = current
        if token_id is None:
            token_id, self.next_id = self.next_id, self.next_id + 1
        self.added[token_id] = AddedToken(token_id, *token.settings())
        self.vocab[token.content] = token_id
        self.changed = True


def build_tokenizer(spec: TokenizerSpec, inputs: Mapping[str, VocabInput], base: str | None) -> BuiltTokenizer:
    """Build the output tokenizer described by ``spec`` from the inputs' tokenizer directories.

    ``inputs`` maps each model key to its :class:`VocabInput`, in config order (the order decides union ids and
    ``chat_template: auto`` ties). ``base`` is the config's base model key, or None; the tokenizer base is then
    the first input. Reads only small tokenizer files. Raises :class:`ConfigError` for token entries or sources
    that do not fit the inputs and :class:`ModelInputError` for unusable tokenizers (not BPE, missing, ids with
    gaps); ``ValueError`` if called without a tokenizer source or with inconsistent inputs.
    """
    if spec.source is None:
        raise ValueError("build_tokenizer needs a spec with a tokenizer source")
    if not inputs or any(k != v.key or v.embed_rows <= 0 for k, v in inputs.items()):
        raise ValueError("inputs must be a non-empty mapping from each input's key to its VocabInput (rows > 0)")
    tok_base = base if base is not None else next(iter(inputs))
    if tok_base not in inputs:
        raise ValueError(f"base model {tok_base!r} is not among the inputs")
    _check_models(spec, inputs)

    readers = {k: read_input_tokenizer(k, v.directory, v.embed_rows) for k, v in inputs.items()}
    fallback = readers[tok_base]
    if fallback is None:
        raise ModelInputError(f"the base model {tok_base} has no tokenizer to build the output tokenizer from")
    warnings = _reader_warnings(readers, tok_base)
    output = _output_vocabulary(spec, readers, tok_base, warnings)
    for entry in spec.tokens:
        if entry.token not in output.vocab:
            output.add(AddedToken(0, entry.token, **_PLAIN))
    tokens = _tokens_by_id(output)
    vocab_size = _padded(len(tokens), spec.pad_to_multiple_of)

    # A model without a tokenizer is taken to share the base's vocabulary, as mergekit assumes.
    sources = tuple(source_rows(tokens, (readers[k] or fallback).vocab, v.embed_rows) for k, v in inputs.items())
    keys = tuple(inputs)
    overrides = _overrides(spec, output.vocab, dict(zip(keys, sources)), readers, inputs)
    alignment = VocabAlignment.from_arrays(
        models=keys,
        base=base,
        vocab_size=vocab_size,
        embed_rows=tuple(v.embed_rows for v in inputs.values()),
        sources=sources,
        overrides=overrides,
        tokens=tokens,
    )
    files = _files(output)
    template = None
    if spec.chat_template is not None:
        template = resolve_chat_template(spec.chat_template, [v.directory for v in inputs.values()])
        if template is not None:
            files = apply_chat_template_files(files, template)
    return BuiltTokenizer(
        files=files,
        vocab_size=vocab_size,
        alignment=alignment,
        digest=_digest(files, vocab_size, alignment),
        chat_template=template,
        warnings=tuple(warnings),
    )


def _check_models(spec: TokenizerSpec, inputs: Mapping[str, VocabInput]) -> None:
    if spec.source not in ("base", "union") and spec.source not in inputs:
        raise ConfigError(
            f"tokenizer source {spec.source} is not one of the merged models",
            yaml_path=spec.source_yaml_path,
            hint=f"use base, union or one of: {', '.join(inputs)}",
        )
    for entry in spec.tokens:
        if entry.source is not None and entry.source.model is not None and entry.source.model not in inputs:
            where = "source" if entry.source.kind == "model" else "source.model"
            raise ConfigError(
                f"model {entry.source.model} is not one of the merged models",
                yaml_path=f"{entry.yaml_path}.{where}",
                hint=f"name one of: {', '.join(inputs)}",
            )


def _reader_warnings(readers: Mapping[str, InputTokenizer | None], tok_base: str) -> list[str]:
    warnings = []
    for key, reader in readers.items():
        if reader is None:
            warnings.append(f"Unable to load tokenizer for {key}. Assuming same as {tok_base}.")
        elif reader.dropped:
            warnings.append(f"{key}: {reader.dropped} tokens with ids >= its {reader.rows} embedding rows were dropped")
    return warnings


def _output_vocabulary(
    spec: TokenizerSpec, readers: Mapping[str, InputTokenizer | None], tok_base: str, warnings: list[str]
) -> _Output:
    name = tok_base if spec.source in ("base", "union") else str(spec.source)
    source = readers[name]
    if source is None:
        raise ModelInputError(f"the tokenizer source {name} has no tokenizer", yaml_path=spec.source_yaml_path)
    output = _Output(source, dict(source.vocab), {a.id: a for a in source.added}, changed=source.dropped > 0)
    if spec.source != "union":
        return output
    others = [r for k, r in readers.items() if k != tok_base and r is not None]
    first_added: dict[str, AddedToken] = {}
    conflicting: set[str] = set()
    for reader in [source, *others]:
        for token in sorted(reader.added, key=lambda a: a.id):
            kept = first_added.setdefault(token.content, token)
            if kept.settings() != token.settings() and token.content not in conflicting:
                conflicting.add(token.content)
                warnings.append(f"Token {token.content!r} added with multiple different settings, using first")
    base_vocab = set(source.vocab)
    seen: set[str] = set()
    for reader in others:
        for text, _ in sorted(reader.vocab.items(), key=lambda item: item[1]):
            if text in base_vocab or text in first_added or text in seen:
                continue
            seen.add(text)
            output.add(AddedToken(0, text, **_PLAIN))
    for token in first_added.values():
        output.add(token)
    return output


def _tokens_by_id(output: _Output) -> tuple[str, ...]:
    size = len(output.vocab)
    tokens: list[str | None] = [None] * size
    for text, token_id in output.vocab.items():
        if token_id >= size or tokens[token_id] is not None:
            break
        tokens[token_id] = text
    else:
        return tuple(t for t in tokens if t is not None)
    raise ModelInputError(
        f"the tokenizer of {output.source.key} does not number its {size} tokens 0..{size - 1} "
        "(ids have gaps or repeats), so its vocabulary cannot be mapped to embedding rows",
        path=str(output.source.directory / TOKENIZER_FILE),
    )


def _padded(size: int, multiple: int | None) -> int:
    if multiple and size % multiple:
        return (size // multiple + 1) * multiple
    return size


def source_rows(tokens: tuple[str, ...], vocab: Mapping[str, int], rows: int) -> npt.NDArray[np.int64]:
    """The row of each of ``tokens`` in a model whose tokenizer's ``vocab`` it is and whose matrix has ``rows``
    rows (-1: it lacks it): an alignment's source array (``check`` compares models of different vocabularies
    with it too)."""
    array = np.fromiter((vocab.get(t, -1) for t in tokens), dtype=np.int64, count=len(tokens))
    # A model without its own tokenizer borrows the base vocabulary, whose ids may pass its own rows.
    array[array >= rows] = -1
    return array


def _overrides(
    spec: TokenizerSpec,
    vocab: Mapping[str, int],
    sources: Mapping[str, npt.NDArray[np.int64]],
    readers: Mapping[str, InputTokenizer | None],
    inputs: Mapping[str, VocabInput],
) -> tuple[TokenOverride, ...]:
    overrides = []
    for entry in spec.tokens:
        src = entry.source
        if src is None:
            continue  # only added: the automatic fill rules apply
        token_id = vocab[entry.token]
        if src.kind == "zero" or src.model is None:
            overrides.append(TokenOverride(token_id, entry.token, entry.force, None, -1, entry.yaml_path))
            continue
        if src.kind == "model":
            row = int(sources[src.model][token_id])
            if row < 0:
                raise ConfigError(
                    f"Token {entry.token!r} not found in model {src.model}", yaml_path=f"{entry.yaml_path}.source"
                )
        elif src.token_id is not None:
            row = src.token_id
            if row >= inputs[src.model].embed_rows:
                raise ConfigError(
                    f"Token ID {row} out of range for model {src.model} ({inputs[src.model].embed_rows} rows)",
                    yaml_path=f"{entry.yaml_path}.source.token_id",
                )
        else:
            reader = readers[src.model]
            if reader is None:
                raise ModelInputError(
                    f"model {src.model} has no tokenizer to look up token {src.token!r} in",
                    yaml_path=f"{entry.yaml_path}.source.token",
                )
            assert src.token is not None
            found = reader.vocab.get(src.token)
            if found is None:
                raise ConfigError(
                    f"Token {src.token!r} not found in model {src.model}", yaml_path=f"{entry.yaml_path}.source.token"
                )
            row = found
        overrides.append(TokenOverride(token_id, entry.token, entry.force, src.model, row, entry.yaml_path))
    return tuple(overrides)


def _files(output: _Output) -> tuple[tuple[str, bytes], ...]:
    source = output.source
    files = dict(source.files)
    if output.changed:
        data = source.data
        data["added_tokens"] = [output.added[i].to_json() for i in sorted(output.added)]
        files[TOKENIZER_FILE] = dump_json(data)
        if CONFIG_FILE in files:
            config = load_json_object(files[CONFIG_FILE], str(source.directory / CONFIG_FILE))
            if isinstance(config.get("added_tokens_decoder"), dict):
                # transformers reads added tokens from here too: keep it in step with tokenizer.json.
                config["added_tokens_decoder"] = {
                    str(i): {k: v for k, v in sorted(output.added[i].to_json().items()) if k != "id"}
                    for i in sorted(output.added)
                }
                files[CONFIG_FILE] = dump_json(config)
    else:
        files[TOKENIZER_FILE] = source.raw
    files.setdefault(CONFIG_FILE, dump_json(dict(_MINIMAL_CONFIG)))
    return tuple(sorted(files.items()))


def _digest(files: tuple[tuple[str, bytes], ...], vocab_size: int, alignment: VocabAlignment) -> str:
    hasher = hashlib.sha256()
    for name, data in files:
        hasher.update(f"{name}\0{len(data)}\0".encode())
        hasher.update(data)
    hasher.update(f"vocab_size\0{vocab_size}\0alignment\0{alignment.digest()}".encode())
    return hasher.hexdigest()
