"""The ggml types' one table (resumerge.inputs.gguf.ggmltypes): every row decoded and encoded, every decoder and
encoder a row's, the rows as gguf-py and llama.cpp's layouts say."""

from __future__ import annotations

import pytest

from resumerge.inputs.gguf import blocks, legacy
from resumerge.inputs.gguf.ggmltypes import BY_NAME, TYPES, block_types, name_of
from resumerge.outputs.gguf import encoders


def test_every_row_is_decoded_and_encoded_and_every_coder_has_a_row() -> None:
    assert all(blocks.decodes(code) and encoders.encodes(code) for code in TYPES)
    plain = set(TYPES) - block_types()
    assert set(blocks._DECODERS) | plain == set(TYPES)
    assert set(encoders._TORCH) | set(encoders.SEARCHED) | set(encoders.UNWEIGHTED) == set(TYPES)
    assert set(encoders.WEIGHTED) <= block_types()
    assert not blocks.decodes(99) and not encoders.encodes(99)


def test_the_rows_are_gguf_py_s() -> None:
    gguf = pytest.importorskip("gguf")
    for code, row in TYPES.items():
        kind = gguf.GGMLQuantizationType(code)
        assert kind.name == row.name and BY_NAME[row.name] is row
        if row.is_block:
            assert tuple(gguf.GGML_QUANT_SIZES[kind]) == row.block, row.name
        else:
            assert row.values == 1 and row.stored == row.name


def test_the_legacy_layouts_are_their_rows_bytes() -> None:
    # a float16 scale, a float16 offset (affine), four bytes of fifth bits (5-bit), 16 bytes of nibbles
    for code, kind in legacy.KINDS.items():
        assert TYPES[code].block == (32, 2 + 2 * kind.affine + 4 * (kind.levels == 31) + 16)


def test_a_fallback_is_a_row_of_smaller_blocks_and_unknown_types_are_named_by_id() -> None:
    for row in TYPES.values():
        if row.fallback >= 0:
            assert row.values % TYPES[row.fallback].values == 0 and row.values > TYPES[row.fallback].values
    assert name_of(12) == "Q4_K" and name_of(29) == "IQ1_M" and name_of(99) == "99"
