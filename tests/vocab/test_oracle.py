"""Differential tests: resumerge's tokenizer merge against mergekit 0.1.5's own functions on the same inputs.

For every scenario both build the output vocabulary from the same tokenizer directories and align the same random
embedding matrices. The vocabularies must hold the same tokens with the same added-token settings, at the same
ids except inside the block of union tokens taken from other models' vocabularies, whose order mergekit leaves to
a Rust hash map (so it changes from run to run; resumerge uses each model's id order). Every aligned row must be
bit-identical, token by token; padding rows too, except where that union block reorders the rows they average.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from resumerge.merge.vocab import BuiltTokenizer, align_rows, build_tokenizer, parse_tokenizer_spec
from tests.vocab.conftest import Trio
from tests.vocab.gen import make_tokenizer_dir, write_model_config
from tests.vocab.oracle import OracleResult, mergekit_merge

pytestmark = [pytest.mark.oracle, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _vocab(built: BuiltTokenizer) -> dict[str, int]:
    data = json.loads(dict(built.files)["tokenizer.json"])
    vocab = dict(data["model"]["vocab"])
    vocab.update({e["content"]: e["id"] for e in data["added_tokens"]})
    return vocab


def _added(built: BuiltTokenizer) -> dict[str, tuple[bool, bool, bool, bool, bool]]:
    data = json.loads(dict(built.files)["tokenizer.json"])
    return {
        e["content"]: (e["single_word"], e["lstrip"], e["rstrip"], e["normalized"], e["special"])
        for e in data["added_tokens"]
    }


def _compare(
    built: BuiltTokenizer,
    oracle: OracleResult,
    ours: list[torch.Tensor],
    keys: list[str],
    *,
    union_block: set[str],
) -> None:
    vocab = _vocab(built)
    assert vocab.keys() == oracle.vocab.keys()
    moved = {t for t in vocab if vocab[t] != oracle.vocab[t]}
    # Only union tokens from other models' vocabularies may sit at other ids, and only among themselves.
    assert moved <= union_block
    assert sorted(vocab[t] for t in moved) == sorted(oracle.vocab[t] for t in moved)
    assert _added(built) == oracle.added
    real = len(vocab)
    by_id = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in by_id] == list(range(real))
    mk_rows = torch.tensor([oracle.vocab[t] for t in by_id])
    for key, tensor in zip(keys, ours):
        expected = oracle.aligned[key]
        assert tensor.shape == expected.shape
        assert tensor.dtype == expected.dtype
        assert torch.equal(tensor[:real], expected[mk_rows]), key
        if moved:
            torch.testing.assert_close(tensor[real:], expected[real:], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(tensor[real:], expected[real:]), key


def _union_block(trio_keys: list[str], base_dir: str) -> set[str]:
    """Tokens of non-base models' vocabularies (not added tokens) that the base lacks."""
    base = json.loads(Path(base_dir, "tokenizer.json").read_text())
    block: set[str] = set()
    for key in trio_keys:
        data = json.loads(Path(key, "tokenizer.json").read_text())
        block |= set(data["model"]["vocab"]) - set(base["model"]["vocab"])
    return block


def _run(trio_keys: list[str], rows: dict[str, int], base: str | None, section: dict[str, Any],
         tensors: dict[str, torch.Tensor]) -> tuple[BuiltTokenizer, OracleResult, list[torch.Tensor]]:
    spec = parse_tokenizer_spec(None, section, None)
    from resumerge.merge.vocab import VocabInput

    built = build_tokenizer(spec, {k: VocabInput(k, Path(k), rows[k]) for k in trio_keys}, base)
    oracle = mergekit_merge(trio_keys, base, section, tensors)
    ours = align_rows(built.alignment, [tensors[k] for k in trio_keys], trio_keys)
    return built, oracle, ours


@pytest.mark.parametrize(
    ("source", "has_base", "dtype"),
    [
        ("base", True, torch.float32),
        ("union", True, torch.float32),
        ("union", False, torch.float32),
        ("union", False, torch.bfloat16),
        ("b", True, torch.float32),
    ],
)
def test_sources_match_mergekit(trio: Trio, source: str, has_base: bool, dtype: torch.dtype) -> None:
    section = {"source": {"b": trio.b}.get(source, source)}
    base = trio.a if has_base else None
    tensors = trio.tensors(dtype)
    built, oracle, ours = _run(trio.keys, trio.rows, base, section, tensors)
    first = trio.a
    _compare(built, oracle, ours, trio.keys, union_block=_union_block(trio.keys, first))
    assert built.vocab_size == len(oracle.vocab)


def test_token_overrides_and_padding_match_mergekit(trio: Trio) -> None:
    section = {
        "source": "union",
        "pad_to_multiple_of": 16,
        "tokens": {
            "<|im_end|>": {"source": trio.b},  # only b has it: every model takes b's row (same as the rule)
            "the": {"source": {"kind": "zero"}, "force": True},  # all have it, forced to zeros everywhere
            "<new>": {"source": {"kind": "model_token", "model": trio.a, "token": "cat"}},
            "Ġcat": {"source": trio.c, "force": True},  # a and c have it; forced to c's row
            "zzz": {"source": {"kind": "model_token", "model": trio.c, "token_id": 3}},
        },
    }
    built, oracle, ours = _run(trio.keys, trio.rows, trio.a, section, trio.tensors())
    _compare(built, oracle, ours, trio.keys, union_block=_union_block(trio.keys, trio.a))
    assert built.vocab_size == 48


def test_overrides_with_base_source_and_padding_are_bit_identical_in_bfloat16(trio: Trio) -> None:
    section = {
        "source": "base",
        "pad_to_multiple_of": 8,
        "tokens": {
            "Ġcat": {"source": {"kind": "model_token", "model": trio.b, "token_id": 5}, "force": True},
            "<|im_start|>": {"source": {"kind": "zero"}},  # c lacks it: c's row is zeros, a and b keep theirs
            "foo": {"source": trio.c},  # b lacks it: b takes c's row (the base rule would give a's)
        },
    }
    built, oracle, ours = _run(trio.keys, trio.rows, trio.a, section, trio.tensors(torch.bfloat16, hidden=6))
    _compare(built, oracle, ours, trio.keys, union_block=set())
    assert built.vocab_size == 32  # 26 base tokens padded to a multiple of 8
    vocab = _vocab(built)
    _, b, c = ours
    assert torch.equal(c[vocab["<|im_start|>"]], torch.zeros(6, dtype=torch.bfloat16))
    assert torch.equal(b[vocab["foo"]], trio.tensors(torch.bfloat16, hidden=6)[trio.c][23])


def test_mergekit_crashes_when_base_source_gains_a_token_and_resumerge_does_not(trio: Trio) -> None:
    """mergekit adds the token to the base tokenizer object itself, then finds its id past the base's rows."""
    section = {"source": "base", "tokens": {"<new>": {"source": trio.b}, "brand": {}}}
    with pytest.raises(KeyError):
        mergekit_merge(trio.keys, trio.a, {"source": "base", "tokens": {"brand": {"force": False}}}, trio.tensors())
    from resumerge.errors import ConfigError

    with pytest.raises(ConfigError, match="Token '<new>' not found in model") as caught:
        _run(trio.keys, trio.rows, trio.a, section, trio.tensors())
    assert caught.value.yaml_path == "tokenizer.tokens.<new>.source"


def test_added_token_redeclaring_a_base_vocabulary_token_and_a_model_without_tokenizer(tmp_path: Path) -> None:
    a, d, e = tmp_path / "a", tmp_path / "d", tmp_path / "e"
    rows = {str(a): make_tokenizer_dir(a, ["the", "cat", "sat", "on", "the", "mat"], ["<|im_start|>", "foo"])}
    rows[str(d)] = make_tokenizer_dir(d, ["a", "dog", "on", "a", "log"], ["cat", "<|im_start|>"], seed=1)
    data = json.loads((d / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        if entry["content"] == "cat":
            entry["special"] = True  # d declares base vocabulary token "cat" as a special added token
        if entry["content"] == "<|im_start|>":
            entry["normalized"] = True  # conflicting settings: the base's (first) definition wins
    (d / "tokenizer.json").write_text(json.dumps(data))
    # transformers re-applies tokenizer_config.json's copy of the added tokens on load: keep both in step.
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        str(entry["id"]): {k: v for k, v in entry.items() if k != "id"} for entry in data["added_tokens"]
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    e.mkdir()
    rows[str(e)] = rows[str(a)]  # e has no tokenizer files: both assume it shares a's vocabulary
    for key, count in rows.items():
        write_model_config(Path(key), count)
    keys = list(rows)
    generator = torch.Generator().manual_seed(3)
    tensors = {k: torch.randn(rows[k], 5, generator=generator) for k in keys}
    built, oracle, ours = _run(keys, rows, str(a), {"source": "union"}, tensors)
    _compare(built, oracle, ours, keys, union_block=_union_block(keys[:2], str(a)))
    assert _added(built)["cat"] == (False, False, False, False, True)
    assert _vocab(built)["cat"] == json.loads((a / "tokenizer.json").read_text())["model"]["vocab"]["cat"]
    assert any("<|im_start|>" in w and "multiple different settings" in w for w in built.warnings)
    assert any(w.startswith(f"Unable to load tokenizer for {e}") for w in built.warnings)
