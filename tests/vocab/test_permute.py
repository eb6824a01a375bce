"""align_rows against hand-computed matrices: one case per fill rule, override kind, padding and layout option.

Output vocabulary t0..t5; models A (3 rows, the base), B (3 rows), C (4 rows):

    token  A   B   C    rule when a model lacks it
    t0     0   1   2    everyone has it
    t1     1   0   -    C lacks it: the base's row (A1); without a base, mean(A1, B0)
    t2     2   -   0    B lacks it: the base's row (A2); without a base, mean(A2, C0)
    t3     -   2   1    A (the base) lacks it: mean(B2, C1)
    t4     -   -   -    nobody has it: zeros
    t5     -   -   3    only C has it: C3
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from resumerge.errors import ConfigError, ModelInputError
from resumerge.merge.vocab import (
    MissingToken,
    TokenOverride,
    VocabAlignment,
    align_rows,
    check_keys,
    missing_rows_report,
)
from resumerge.merge.vocab import permute as permute_module

A = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
B = torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]])
C = torch.tensor([[100.0, 200.0], [300.0, 400.0], [500.0, 600.0], [700.0, 800.0]])
TOKENS = ("t0", "t1", "t2", "t3", "t4", "t5")
SOURCES = {"A": [0, 1, 2, -1, -1, -1], "B": [1, 0, -1, 2, -1, -1], "C": [2, -1, 0, 1, -1, 3]}
ZERO = [0.0, 0.0]


def _alignment(
    base: str | None = "A", vocab_size: int = 6, overrides: tuple[TokenOverride, ...] = ()
) -> VocabAlignment:
    return VocabAlignment.from_arrays(
        models=("A", "B", "C"),
        base=base,
        vocab_size=vocab_size,
        embed_rows=(3, 3, 4),
        sources=tuple(np.array(SOURCES[k], dtype=np.int64) for k in "ABC"),
        overrides=overrides,
        tokens=TOKENS,
    )


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows)


def test_every_fill_rule_with_a_base_model() -> None:
    a, b, c = align_rows(_alignment(), [A, B, C], ["A", "B", "C"])
    t3_mean = [175.0, 230.0]  # (B2 + C1) / 2
    assert torch.equal(a, _rows([1, 2], [3, 4], [5, 6], t3_mean, ZERO, [700, 800]))
    assert torch.equal(b, _rows([30, 40], [10, 20], [5, 6], [50, 60], ZERO, [700, 800]))
    assert torch.equal(c, _rows([500, 600], [3, 4], [100, 200], [300, 400], ZERO, [700, 800]))


def test_without_a_base_rows_two_models_share_are_averaged() -> None:
    a, b, c = align_rows(_alignment(base=None), [A, B, C], ["A", "B", "C"])
    assert torch.equal(c[1], torch.tensor([6.5, 12.0]))  # (A1 + B0) / 2
    assert torch.equal(b[2], torch.tensor([52.5, 103.0]))  # (A2 + C0) / 2
    assert torch.equal(a[3], torch.tensor([175.0, 230.0]))


def test_a_slice_level_base_replaces_the_alignment_base() -> None:
    a, b, c = align_rows(_alignment(), [A, B, C], ["A", "B", "C"], base="B")
    assert torch.equal(c[1], torch.tensor([10.0, 20.0]))  # B0, the slice base's row
    assert torch.equal(b[2], torch.tensor([52.5, 103.0]))  # base B lacks t2: mean(A2, C0)
    assert torch.equal(a[3], torch.tensor([50.0, 60.0]))  # B2


def test_rules_count_only_the_models_merged_into_the_tensor() -> None:
    # A (the base) is not merged here: t1 and t2 each have one owner among B and C.
    b, c = align_rows(_alignment(), [B, C], ["B", "C"])
    assert torch.equal(b, _rows([30, 40], [10, 20], [100, 200], [50, 60], ZERO, [700, 800]))
    assert torch.equal(c, _rows([500, 600], [10, 20], [100, 200], [300, 400], ZERO, [700, 800]))


def test_padding_rows_are_each_models_mean_real_row() -> None:
    a, b, _ = align_rows(_alignment(vocab_size=8), [A, B, C], ["A", "B", "C"])
    assert a.shape == (8, 2)
    expected_a = torch.tensor([(1 + 3 + 5 + 175 + 0 + 700) / 6, (2 + 4 + 6 + 230 + 0 + 800) / 6])
    torch.testing.assert_close(a[6], expected_a)
    torch.testing.assert_close(a[7], expected_a)
    torch.testing.assert_close(b[6], torch.tensor([(30 + 10 + 5 + 50 + 700) / 6, (40 + 20 + 6 + 60 + 800) / 6]))
    assert torch.equal(a[:6], align_rows(_alignment(), [A, B, C], ["A", "B", "C"])[0])


def test_overrides_zero_model_row_model_token_and_force() -> None:
    overrides = (
        TokenOverride(0, "t0", True, "B", 2, "tokenizer.tokens.t0"),  # forced: everyone takes B2
        TokenOverride(1, "t1", True, None, -1, "tokenizer.tokens.t1"),  # forced zeros
        TokenOverride(3, "t3", False, "C", 0, "tokenizer.tokens.t3"),  # model_token: A (lacking t3) takes C0
        TokenOverride(5, "t5", False, None, -1, "tokenizer.tokens.t5"),  # zero instead of C3 for A and B
    )
    a, b, c = align_rows(_alignment(overrides=overrides), [A, B, C], ["A", "B", "C"])
    assert torch.equal(a, _rows([50, 60], ZERO, [5, 6], [100, 200], ZERO, ZERO))
    assert torch.equal(b, _rows([50, 60], ZERO, [5, 6], [50, 60], ZERO, ZERO))
    assert torch.equal(c, _rows([50, 60], ZERO, [100, 200], [300, 400], ZERO, [700, 800]))


def test_an_override_from_a_model_outside_the_tensor_fails_only_when_needed() -> None:
    needed = _alignment(overrides=(TokenOverride(3, "t3", False, "C", 0, "tokenizer.tokens.t3"),))
    with pytest.raises(ConfigError, match="requires a vocabulary weight from model C") as caught:
        align_rows(needed, [A, B], ["A", "B"])
    assert caught.value.yaml_path == "tokenizer.tokens.t3.source"
    unused = _alignment(overrides=(TokenOverride(0, "t0", False, "C", 0, "tokenizer.tokens.t0"),))
    check_keys(unused, ["A", "B"])  # A and B both have t0 and it is not forced
    a, _ = align_rows(unused, [A, B], ["A", "B"])
    assert torch.equal(a[0], A[0])


def test_missing_rows_report_names_unconfigured_tokens_nobody_has() -> None:
    assert missing_rows_report(_alignment(), ["A", "B", "C"]) == (MissingToken(4, "t4"),)
    assert missing_rows_report(_alignment(), ["A", "B"]) == (MissingToken(4, "t4"), MissingToken(5, "t5"))
    configured = _alignment(overrides=(TokenOverride(4, "t4", False, None, -1, "tokenizer.tokens.t4"),))
    assert missing_rows_report(configured, ["A", "B", "C"]) == ()
    assert MissingToken(4, "t4").message() == "Token 't4' not found in any model"


def test_dtype_is_kept_and_mixed_dtypes_promote() -> None:
    out = align_rows(_alignment(), [A.bfloat16(), B.bfloat16(), C.bfloat16()], ["A", "B", "C"])
    assert [t.dtype for t in out] == [torch.bfloat16] * 3
    assert torch.equal(out[0].float()[3], torch.tensor([175.0, 230.0]))
    mixed = align_rows(_alignment(), [A.half(), B, C.bfloat16()], ["A", "B", "C"])
    assert [t.dtype for t in mixed] == [torch.float32] * 3
    assert torch.equal(mixed[0], align_rows(_alignment(), [A, B, C], ["A", "B", "C"])[0])


def test_other_axis_and_trailing_dimensions() -> None:
    expected = align_rows(_alignment(vocab_size=7), [A, B, C], ["A", "B", "C"])
    transposed = align_rows(_alignment(vocab_size=7), [A.T, B.T, C.T], ["A", "B", "C"], axis=1)
    for got, want in zip(transposed, expected):
        assert got.shape == (2, 7) and got.is_contiguous()
        assert torch.equal(got, want.T)
    vectors = align_rows(_alignment(), [A[:, 0], B[:, 0], C[:, 0]], ["A", "B", "C"])
    assert torch.equal(vectors[0], expected[0][:6, 0])


def test_chunked_gathers_give_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = align_rows(_alignment(vocab_size=8), [A, B, C], ["A", "B", "C"])
    monkeypatch.setattr(permute_module, "_CHUNK_ROWS", 1)
    chunked = align_rows(_alignment(vocab_size=8), [A, B, C], ["A", "B", "C"])
    assert all(torch.equal(x, y) for x, y in zip(whole, chunked))


def test_shape_and_key_errors() -> None:
    alignment = _alignment()
    with pytest.raises(ModelInputError, match="C has 3 rows but its tokenizer needs 4"):
        align_rows(alignment, [A, B, C[:3]], ["A", "B", "C"])
    with pytest.raises(ModelInputError, match="differ outside the vocabulary axis"):
        align_rows(alignment, [A, torch.zeros(3, 3), C], ["A", "B", "C"])
    with pytest.raises(ValueError, match="not an input"):
        align_rows(alignment, [A], ["Z"])
    with pytest.raises(ValueError, match="one tensor per key"):
        align_rows(alignment, [A, B], ["A"])


def test_alignment_round_trips_and_digest_covers_every_row() -> None:
    alignment = _alignment(overrides=(TokenOverride(4, "t4", True, None, -1, "tokenizer.tokens.t4"),))
    again = VocabAlignment.from_json(alignment.to_json())
    assert again == alignment
    assert again.digest() == alignment.digest()
    assert list(again.source_rows("C")) == SOURCES["C"]
    assert alignment.names == ((1, "t1"), (2, "t2"), (3, "t3"), (4, "t4"), (5, "t5"))
    changed = VocabAlignment.from_arrays(
        models=("A", "B", "C"),
        base="A",
        vocab_size=6,
        embed_rows=(3, 3, 4),
        sources=(np.array([0, 1, 2, -1, -1, -1]), np.array([1, 0, -1, 2, -1, -1]), np.array([2, -1, 0, 1, -1, 2])),
        overrides=alignment.overrides,
        tokens=TOKENS,
    )
    assert changed.digest() != alignment.digest()
    with pytest.raises(ValueError, match="read-only"):
        alignment.source_rows("A")[0] = 5


def test_identity_rows_encode_as_one_run() -> None:
    identity = np.arange(100_000, dtype=np.int64)
    alignment = VocabAlignment.from_arrays(
        models=("m",),
        base=None,
        vocab_size=100_000,
        embed_rows=(100_000,),
        sources=(identity,),
        overrides=(),
        tokens=tuple(f"tok{i}" for i in range(100_000)),
    )
    assert alignment.runs == (((0, 100_000, 0),),)
    assert alignment.names == ()
    assert len(alignment.to_json()) < 200
    assert np.array_equal(alignment.source_rows("m"), identity)
