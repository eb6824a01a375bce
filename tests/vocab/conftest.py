"""Three small models with overlapping but different vocabularies, shared by the tokenizer-merge tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from resumerge.merge.vocab import VocabInput
from tests.vocab.gen import make_tokenizer_dir, write_model_config


@dataclass(frozen=True)
class Trio:
    """Models a (base), b, c keyed by directory path; ``rows`` are their embedding rows.

    a: "the cat sat on the mat" + <|im_start|>, foo. b: another sentence, ids shuffled, + <|im_end|>,
    <|im_start|>, bar. c: a third sentence, shuffled, + foo, <|extra|>, with one row fewer than tokens, so
    <|extra|> has no embedding row and must be dropped.
    """

    a: str
    b: str
    c: str
    rows: dict[str, int]

    @property
    def keys(self) -> list[str]:
        return [self.a, self.b, self.c]

    def inputs(self, keys: list[str] | None = None) -> dict[str, VocabInput]:
        return {k: VocabInput(k, Path(k), self.rows[k]) for k in keys or self.keys}

    def tensors(self, dtype: torch.dtype = torch.float32, hidden: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {k: torch.randn(self.rows[k], hidden, generator=generator).to(dtype) for k in self.keys}


def make_trio(root: Path) -> Trio:
    a, b, c = (root / name for name in ("a", "b", "c"))
    rows = {
        str(a): make_tokenizer_dir(a, ["the", "cat", "sat", "on", "the", "mat"], ["<|im_start|>", "foo"]),
        str(b): make_tokenizer_dir(
            b, ["the", "dog", "sat", "on", "the", "log"], ["<|im_end|>", "<|im_start|>", "bar"], seed=2
        ),
        str(c): make_tokenizer_dir(c, ["a", "cat", "and", "a", "dog", "ran"], ["foo", "<|extra|>"], seed=5) - 1,
    }
    for key, count in rows.items():
        write_model_config(Path(key), count)
    return Trio(str(a), str(b), str(c), rows)


@pytest.fixture
def trio(tmp_path: Path) -> Trio:
    return make_trio(tmp_path / "models")
