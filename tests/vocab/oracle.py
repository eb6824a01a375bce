"""Run mergekit 0.1.5's own tokenizer merge (``tokenizer/build.py`` + ``PermutedVocabulary``) as a test oracle.

Model keys are the models' directory paths, which mergekit parses as local model references, so one config
(``tokens:`` entries naming models included) means the same to both implementations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OracleResult:
    """mergekit's output vocabulary, added-token settings and aligned tensors (by model key)."""

    vocab: dict[str, int]
    added: dict[str, tuple[bool, bool, bool, bool, bool]]
    aligned: dict[str, torch.Tensor]


def mergekit_merge(
    keys: list[str],
    base: str | None,
    tokenizer: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
) -> OracleResult:
    """Build mergekit's tokenizer for models ``keys`` (local dirs) and align ``tensors`` (in ``keys`` order)."""
    from mergekit.common import ModelReference
    from mergekit.tokenizer.build import build_tokenizer
    from mergekit.tokenizer.config import TokenizerConfig
    from mergekit.tokenizer.embed import PermutedVocabulary

    refs = {k: ModelReference.parse(k) for k in keys}
    config = TokenizerConfig.model_validate(dict(tokenizer))
    base_ref = refs[base] if base is not None else None
    info = build_tokenizer(
        base_model=base_ref,
        referenced_models=list(refs.values()),
        tokenizer_source=config.source,
        trust_remote_code=False,
        add_tokens=list((config.tokens or {}).keys()),
    )
    task = PermutedVocabulary.model_construct(
        tokens=config.tokens,
        pad_to_multiple_of=config.pad_to_multiple_of,
        base_model=base_ref,
        vocabulary_axis=0,
    )
    aligned = task.execute(tokenizer_info=info, tensors={refs[k]: tensors[k] for k in keys})
    added = {
        t.content: (t.single_word, t.lstrip, t.rstrip, t.normalized, t.special)
        for t in info.tokenizer.added_tokens_decoder.values()
    }
    return OracleResult(
        vocab=dict(info.tokenizer.get_vocab()),
        added=added,
        aligned={k: aligned[refs[k]] for k in keys},
    )
