"""The ggml tensor types resumerge decodes and encodes, one row each: the one place a type's facts are written.

A row holds the type's id (``ggml_type``), its name (``ggml_type_name`` upper-cased, gguf-py's
``GGMLQuantizationType`` name), a block's values and bytes (``ggml-common.h``; a plain type: one value and its
bytes), the stored dtype of a plain type, the relative error of its round trip (the budget a GGUF codec reports),
whether llama.cpp's quantizer writes it only with an importance matrix, and the type a row that is not whole blocks
of it falls back to (``tensor_type_fallback``). Everything else reads it: the decoders (:mod:`.blocks`, registered
there by id), the encoders (:mod:`resumerge.outputs.gguf.encoders`, likewise), the name maps, the budgets and the
type rules of a GGUF output (:mod:`resumerge.merge.plan.gguftypes`).

A new type is one row of ``_ROWS`` here (its fallback's row above it), its decoder in :mod:`.blocks` ``_DECODERS``
and its encoder in :mod:`resumerge.outputs.gguf.encoders` ``ENCODERS``; tests/test_ggml_table.py holds the three
equal.

May import: nothing (read by the input and the output side alike, and by the plan).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["BY_NAME", "TYPES", "GgmlType", "block_types", "name_of"]


@dataclass(frozen=True)
class GgmlType:
    """One ggml tensor type: see the module's docstring."""

    name: str
    code: int
    values: int  # values a block (1: a plain type)
    size: int  # bytes a block
    stored: str = ""  # a plain type's stored dtype (safetensors' name); "": rows of block bytes (U8)
    round_trip: float | None = None  # % RMS error of one round trip of N(0, 1) values; None: no more than BF16's
    needs_imatrix: bool = False  # llama.cpp's tensor_requires_imatrix
    fallback: int = -1  # the type of a row that is not whole blocks of this one (-1: none)

    @property
    def block(self) -> tuple[int, int]:
        """(values, bytes) of a block."""
        return self.values, self.size

    @property
    def is_block(self) -> bool:
        """Whether it is stored as rows of block bytes (not a plain dtype)."""
        return not self.stored


# One row a type (its id bound to the type's name here; a fallback's row above the rows that name it).
_ROWS = (
    # The round-trip errors: the legacy types and Q8_0 measured with resumerge's encoders (byte-equal to gguf-py's), the
    # K-quants as reference/gguf.md §5 gives them (libgguf's encoders), IQ4_NL, IQ4_XS, IQ3_S and IQ3_XXS measured with
    # resumerge's (llama.cpp's bytes, without an importance matrix); RMS of 256 x 1024 N(0, 1) values, in %.
    GgmlType("F32", F32 := 0, 1, 4, stored="F32"),
    GgmlType("F16", F16 := 1, 1, 2, stored="F16"),
    GgmlType("BF16", BF16 := 30, 1, 2, stored="BF16"),
    GgmlType("Q8_0", Q8_0 := 8, 32, 34, round_trip=0.54),
    GgmlType("Q5_1", Q5_1 := 7, 32, 24, round_trip=3.8),
    GgmlType("Q5_0", Q5_0 := 6, 32, 22, round_trip=4.3),
    GgmlType("Q4_1", Q4_1 := 3, 32, 20, round_trip=7.9),
    GgmlType("Q4_0", Q4_0 := 2, 32, 18, round_trip=8.6),
    GgmlType("Q2_K", Q2_K := 10, 256, 84, fallback=Q4_0),
    GgmlType("Q3_K", Q3_K := 11, 256, 110, fallback=Q4_0),
    GgmlType("Q4_K", Q4_K := 12, 256, 144, round_trip=7.2, fallback=Q5_0),
    GgmlType("Q5_K", Q5_K := 13, 256, 176, round_trip=3.6, fallback=Q5_1),
    GgmlType("Q6_K", Q6_K := 14, 256, 210, round_trip=1.8, fallback=Q8_0),
    GgmlType("IQ4_NL", IQ4_NL := 20, 32, 18, round_trip=7.6),
    GgmlType("IQ4_XS", IQ4_XS := 23, 256, 136, round_trip=7.7, fallback=IQ4_NL),
    GgmlType("IQ3_XXS", IQ3_XXS := 18, 256, 98, round_trip=21.0, needs_imatrix=True, fallback=IQ4_NL),
    GgmlType("IQ3_S", IQ3_S := 21, 256, 110, round_trip=17.0, fallback=IQ4_NL),
    GgmlType("IQ2_XXS", IQ2_XXS := 16, 256, 66, needs_imatrix=True, fallback=IQ4_NL),
    GgmlType("IQ2_XS", IQ2_XS := 17, 256, 74, needs_imatrix=True, fallback=IQ4_NL),
    GgmlType("IQ2_S", IQ2_S := 22, 256, 82, needs_imatrix=True, fallback=IQ4_NL),
    # The ternary types keep a ternary tensor exactly, a normal one hardly (resumerge.outputs.gguf.tquants); MXFP4's
    # error measured with resumerge's encoder (llama.cpp's bytes).
    GgmlType("TQ1_0", TQ1_0 := 34, 256, 54, round_trip=81.0, fallback=Q4_0),
    GgmlType("TQ2_0", TQ2_0 := 35, 256, 66, round_trip=81.0, fallback=Q4_0),
    GgmlType("MXFP4", MXFP4 := 39, 32, 17, round_trip=11.5),
    # The 1-bit i-quants' errors measured with resumerge's encoders under a uniform importance matrix (they need one).
    GgmlType("IQ1_S", IQ1_S := 19, 256, 50, round_trip=48.6, needs_imatrix=True, fallback=IQ4_NL),
    GgmlType("IQ1_M", IQ1_M := 29, 256, 56, round_trip=45.2, needs_imatrix=True, fallback=IQ4_NL),
)

# ggml type id -> its row; name -> its row (in the rows' order: the order the override flags' choices are listed in)
TYPES: Mapping[int, GgmlType] = MappingProxyType({row.code: row for row in _ROWS})
BY_NAME: Mapping[str, GgmlType] = MappingProxyType({row.name: row for row in _ROWS})


def name_of(code: int) -> str:
    """Type ``code``'s name (the id itself where it has no row)."""
    row = TYPES.get(code)
    return str(code) if row is None else row.name


def block_types() -> frozenset[int]:
    """The ids of the types stored as block bytes."""
    return frozenset(code for code, row in TYPES.items() if row.is_block)
