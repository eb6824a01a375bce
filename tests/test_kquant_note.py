"""A run writing K-quants says when numba is missing (the numpy path writes the same bytes in ~3x the CPU)."""

from __future__ import annotations

import pytest

from resumerge.api.merge_kind import numpy_encoders_note
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.outputs.gguf import jit


@pytest.mark.parametrize("mix", ["q4_k_m", "q2_k", "q6_k", "q3_k_s"])
def test_a_k_quant_run_without_numba_is_told_how_to_get_the_compiled_encoders(monkeypatch: pytest.MonkeyPatch,
                                                                               mix: str) -> None:
    monkeypatch.setattr(jit, "numba_module", lambda: None)
    note = numpy_encoders_note(PlanOptions(out_type="gguf", gguf_type=mix))
    assert note is not None and mix in note and "numba" in note and "kquants" in note


@pytest.mark.parametrize("options", [PlanOptions(out_type="gguf", gguf_type="f16"),
                                     PlanOptions(out_type="gguf", gguf_type="q8_0"),
                                     PlanOptions(out_type="safetensors")])
def test_no_note_where_nothing_is_k_quant(monkeypatch: pytest.MonkeyPatch, options: PlanOptions) -> None:
    monkeypatch.setattr(jit, "numba_module", lambda: None)
    assert numpy_encoders_note(options) is None


def test_no_note_where_numba_is_there() -> None:
    pytest.importorskip("numba")
    assert numpy_encoders_note(PlanOptions(out_type="gguf", gguf_type="q4_k_m")) is None
