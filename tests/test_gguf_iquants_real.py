"""The IQ4 mixes on a real model (issue 95's check): SmolLM2-135M (llama, 30 layers, 576-wide rows that take
IQ4_NL in an IQ4_XS file, 1536-wide ``ffn_down`` that keeps IQ4_XS, tied embeddings) from its GGUF fixture, passed
through resumerge to ``--gguf-type iq4_xs`` and ``iq4_nl``: every tensor's type and bytes equal
``llama_model_quantize``'s for the mix on the F16 GGUF resumerge wrote of the same merge, without and with an
importance matrix (which turns the first three ``ffn_down`` from Q5_K to IQ4_XS); ``iq2_xxs`` with a matrix
(IQ4_NL for the 576-wide rows, IQ2_XXS for ``ffn_down``, Q2_K for the first eighth's, Q5_K for the tied embedding:
passed, 10 min on this shared machine); ``iq4_nl`` and ``iq2_xs`` with ``RESUMERGE_TEST_EVERY_MIX=1``
(tests/test_gguf_iquants.py and tests/test_gguf_iq2.py check their mixes on tiny models). Skipped where llama.cpp's
library (the test-only oracle) does not load. All three ran on this change: 3 passed."""

from __future__ import annotations

from pathlib import Path

import pytest
from llamacpp_oracle import needs_library, quantize_model, tensors_of
from support import write_config
from test_gguf_kquants_real import EVERY_MIX, _imatrix, write_imatrix

from resumerge import api
from resumerge.merge.plan.gguftypes import MIXES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_f16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the config of a float16 passthrough merge of SmolLM2's GGUF fixture, the F16 GGUF resumerge writes of it)."""
    needs_library()
    from realmodel import smollm2_gguf

    root = tmp_path_factory.mktemp("smollm2")
    config = write_config(root / "c.yml", {"merge_method": "passthrough", "dtype": "float16",
                                           "models": [{"model": str(smollm2_gguf())}]})
    api.run(config, root / "f16", settings=api.Settings(state_dir=root / "s", output=api.Output(out_type="gguf",
                                                                                                gguf_type="f16")))
    return config, root / "f16" / "model.gguf"


@pytest.mark.parametrize(("mix", "weighted"), [("iq4_xs", False), ("iq4_xs", True), ("iq2_xxs", True),
                                               *((("iq4_nl", False), ("iq2_xs", True)) if EVERY_MIX else ())])
def test_each_iq4_mix_of_a_real_model_is_llama_quantize_s(mix: str, weighted: bool, smollm2_f16: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    config, f16 = smollm2_f16
    output = api.Output(out_type="gguf", gguf_type=mix)
    entries = None
    if weighted:
        entries = _imatrix(f16)
        write_imatrix(tmp_path / "imatrix.gguf", entries)
        output = api.Output(out_type="gguf", gguf_type=mix, imatrix=str(tmp_path / "imatrix.gguf"))
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=output))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES[mix].file_type, imatrix=entries)
    got, want = tensors_of(tmp_path / "out" / "model.gguf"), tensors_of(tmp_path / "llama.gguf")
    assert got.keys() == want.keys()
    assert {n: got[n].kind for n in got} == {n: want[n].kind for n in want}
    assert [n for n in got if got[n] != want[n]] == []
    down = [got[f"blk.{i}.ffn_down.weight"].kind for i in range(4)]
    if mix == "iq4_xs":  # the matrix changes the first eighth's type, not only its bytes
        assert down == ["IQ4_XS"] * 4 if weighted else down == ["Q5_K"] * 3 + ["IQ4_XS"]
        assert got["blk.0.attn_q.weight"].kind == "IQ4_NL"  # 576 values a row: IQ4_XS's fallback
