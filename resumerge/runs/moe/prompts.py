"""The experts' prompts tokenised as mergekit-moe does it, with the base model's tokenizer through transformers
(the one dependency of the prompt gate modes): left padding, the pad token set to BOS (else EOS), every prompt
``bos_token + prompt`` without added special tokens, each set padded to its longest prompt."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from resumerge.errors import InputError
from resumerge.forward.engine.requires import require_transformers
from resumerge.forward.text.texts import tokenizer_at
from resumerge.runs.moe.passproc import gate_needs
from resumerge.runs.moe.routers import Encoded


def load_tokenizer(directory: Path, gate_mode: str) -> Any:
    """The base model's tokenizer, set up for the prompts as mergekit-moe sets it up."""
    transformers = require_transformers(gate_needs(gate_mode))
    try:
        tokenizer = tokenizer_at(transformers, directory)
    except Exception as exc:  # the tokenizers library raises a bare Exception for a tokenizer.json it cannot read
        raise InputError(f"cannot load the base model's tokenizer from {directory}: {exc}", yaml_path="base_model",
                         hint=_tokenizer_fix(transformers, directory)) from None
    tokenizer.padding_side = "left"
    tokenizer.pad_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_fix(transformers: Any, directory: Path) -> str:
    """What to do about a tokenizer this transformers cannot load: a newer transformers when its
    tokenizer_config.json names a class this one lacks (transformers 5 saves ``TokenizersBackend``, which 4.x
    does not have), else a tokenizer it reads."""
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    version = transformers.__version__
    if isinstance(named, str) and named and getattr(transformers, named, None) is None:
        upgrade = ("transformers 5 saved it: pip install -U 'transformers>=5'" if named == "TokenizersBackend"
                   else "pip install -U transformers")
        return (f"its tokenizer_config.json names tokenizer_class {named}, which transformers {version} does not "
                f"have ({upgrade}), or use gate_mode random or uniform_random")
    return (f"give the base model a tokenizer that transformers {version} loads (AutoTokenizer.from_pretrained), "
            "or use gate_mode random or uniform_random")


def encode(tokenizer: Any, prompts: Sequence[str]) -> Encoded:
    """One prompt set as (input_ids rows, attention_mask rows)."""
    batch = tokenizer([(tokenizer.bos_token or "") + p for p in prompts], padding=True, add_special_tokens=False)
    return (tuple(tuple(int(i) for i in row) for row in batch["input_ids"]),
            tuple(tuple(int(m) for m in row) for row in batch["attention_mask"]))
