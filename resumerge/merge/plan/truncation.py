"""``--unsafe-truncate-embeddings``: merge models whose vocabularies differ in size by keeping common leading rows.

mergekit's rule (``mergekit-modules-moe.md`` §3.2): for a vocabulary tensor (token embedding, output head) whose
inputs differ only in their row count, every input keeps rows ``[0, min)`` — the lowest token ids — which assumes
the models give those ids the same tokens. mergekit then leaves config.json's ``vocab_size`` and the donor's
tokenizer as they were, so an output cut to 64 rows from a 66-token donor does not load. Here the output is made
consistent: ``vocab_size`` follows the rows written (``outconfig``), and a donor tokenizer with ids past them is
cut to match (:func:`cut_tokenizer_files`): ids past the rows leave ``tokenizer.json`` (vocabulary, added tokens,
and the merges that use or make them), ``added_tokens_decoder`` and ``added_tokens.json``. A special token the
donor's configuration still names and the cut removes is refused (exit 2) rather than silently re-added past the
rows by transformers. The plan records what was cut (:func:`truncation_notes`) for the log, ``status`` and the
model card.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.errors import ConfigError, ModelInputError
from resumerge.merge.vocab.reader import read_input_tokenizer

if TYPE_CHECKING:
    from resumerge.inputs.model import ModelInput
    from resumerge.merge.plan.merge_plan import InputRef, TensorPlan

# tokenizer_config.json / special_tokens_map.json keys naming one special token.
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def common_rows(shapes: Sequence[tuple[int, ...]]) -> int | None:
    """The rows every input keeps when the shapes differ only in their first axis, else None (nothing to cut,
    or a difference truncation cannot fix)."""
    if len({s[0] for s in shapes if s}) <= 1 or len({s[1:] for s in shapes}) > 1 or not all(shapes):
        return None
    return min(s[0] for s in shapes)


def leading_rows(ref: InputRef, rows: int, *, yaml_path: str) -> InputRef:
    """``ref`` limited to its first ``rows`` rows (a prefix of its bytes: tensors are stored row-major)."""
    if ref.shape[0] == rows:
        return ref
    if ref.lora is not None:
        raise ConfigError(
            f"{ref.tensor} of {ref.model} has a LoRA delta and cannot be truncated to {rows} rows",
            yaml_path=yaml_path, hint="merge the adapter first, or align vocabularies with tokenizer_source: base",
        )
    return ref.rows(0, rows)


def truncation_notes(tensors: Mapping[str, TensorPlan], models: Mapping[str, ModelInput]) -> tuple[str, ...]:
    """One sentence per output tensor whose inputs were cut: the inputs' row counts and the rows kept."""
    notes = []
    for name in sorted(tensors):
        plan = tensors[name]
        stored = []
        for ref in plan.inputs:
            found = models[ref.model].tensors.get(ref.tensor) if ref.model in models else None
            stored.append((ref.model, found.entry.shape[0] if found is not None and found.entry.shape else None))
        if any(rows is not None and rows != plan.shape[0] for _, rows in stored):
            listing = ", ".join(f"{model} has {rows}" for model, rows in stored)
            notes.append(f"UNSAFE vocabulary truncation of {name}: {listing} rows; kept the first {plan.shape[0]} "
                         "(assumes the models share those token ids)")
    return tuple(notes)


def cut_tokenizer_files(key: str, directory: Path, rows: int, files: Sequence[str]) -> dict[str, bytes] | None:
    """The donor's tokenizer files (``files``, names in ``directory``) cut to ids below ``rows``; None when
    nothing needs cutting. Raises :class:`ConfigError` when the cut removes a special token the configuration
    names, :class:`ModelInputError` for a tokenizer with ids past ``rows`` that is not a BPE tokenizer.json."""
    cut = read_input_tokenizer(key, directory, rows)
    if cut is None or not cut.dropped:
        if cut is None and _max_added_id(directory) >= rows:
            raise ModelInputError(f"the tokenizer of {key} has ids past the {rows} rows kept and no tokenizer.json "
                                  "to cut", path=str(directory), hint="use a model with a fast tokenizer as base_model")
        return None
    kept = set(cut.vocab)
    out: dict[str, bytes] = {}
    for name in files:
        data = (directory / name).read_bytes()
        if name == "tokenizer.json":
            data = (json.dumps(cut.data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
        elif name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
            doc = json.loads(data)
            _check_specials(doc, kept, key, rows, name)
            doc = _without_ids(doc, rows, name)
            data = (json.dumps(doc, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
        out[name] = data
    return out


def _without_ids(doc: Any, rows: int, name: str) -> Any:
    if not isinstance(doc, dict):
        return doc
    if name == "added_tokens.json":  # token -> id
        return {k: v for k, v in doc.items() if not (type(v) is int and v >= rows)}
    if isinstance(doc.get("added_tokens_decoder"), dict):
        doc = {**doc, "added_tokens_decoder": {k: v for k, v in doc["added_tokens_decoder"].items()
                                               if not k.isdigit() or int(k) < rows}}
    return doc


def _check_specials(doc: Any, kept: set[str], key: str, rows: int, name: str) -> None:
    if not isinstance(doc, dict):
        return
    for special in _SPECIAL_KEYS:
        value = doc.get(special)
        token = value.get("content") if isinstance(value, dict) else value
        if isinstance(token, str) and token not in kept:
            raise ConfigError(
                f"--unsafe-truncate-embeddings keeps {rows} rows, but the {special} {token!r} of {key}'s tokenizer "
                f"({name}) has an id past them",
                yaml_path="base_model",
                hint="make the model with the smaller vocabulary the base_model, or align vocabularies with "
                     "tokenizer_source: base",
            )


def _max_added_id(directory: Path) -> int:
    path = directory / "tokenizer_config.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return -1
    decoder = doc.get("added_tokens_decoder") if isinstance(doc, dict) else None
    ids = [int(k) for k in decoder if k.isdigit()] if isinstance(decoder, dict) else []
    return max(ids, default=-1)
