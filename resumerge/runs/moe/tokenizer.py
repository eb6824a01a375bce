"""The output tokenizer: the base model's tokenizer files with its pad token set as mergekit-moe sets it (BOS,
else EOS). mergekit re-saves the tokenizer through transformers, whose bytes depend on its version; here the
base's files are kept byte for byte except the pad token added to ``tokenizer_config.json`` (and to
``special_tokens_map.json`` when there is one), so the output does not depend on which transformers is
installed, and loads with the same tokens and pad token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resumerge.inputs.files import TOKENIZER_FILES

# Files of a model folder that are not the tokenizer's (mergekit-moe writes none of them).
_NOT_TOKENIZER = frozenset({"generation_config.json", "preprocessor_config.json", "processor_config.json",
                            "video_preprocessor_config.json"})
_WITH_PAD = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_blobs(directory: Path) -> dict[str, bytes]:
    """The output tokenizer files (name -> bytes) made from the base's ``directory``; empty without
    a tokenizer_config.json (then none is written, like a base with no tokenizer)."""
    if not (directory / "tokenizer_config.json").is_file():
        return {}
    files = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES
             if name not in _NOT_TOKENIZER and (directory / name).is_file()}
    settings = json.loads(files["tokenizer_config.json"])
    pad = _token(settings.get("bos_token")) or _token(settings.get("eos_token"))
    if pad is None:
        return files
    for name in _WITH_PAD:
        if name in files:
            doc = json.loads(files[name])
            doc["pad_token"] = pad
            files[name] = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
