"""The IQ4, IQ3 and IQ2 mixes on a real model (issue 95's check): SmolLM2-135M (llama, 576-wide rows that take
IQ4_NL in an IQ4_XS file, 1536-wide ``ffn_down`` that keeps IQ4_XS, tied embeddings) from its GGUF fixture, its first
``LAYERS`` layers (every tensor's shape and every branch of the mixes' layer rules), passed through resumerge to
``--gguf-type iq4_xs`` and ``iq4_nl``: every tensor's type and bytes equal ``llama_model_quantize``'s for the mix on the
F16 GGUF resumerge wrote of the same merge, without and with an importance matrix (which turns the first eighth of
``ffn_down`` from Q5_K to IQ4_XS); the IQ3 mixes (SmolLM2's 1536-wide ``ffn_down`` written by the IQ3 encoders) and the
IQ2 ones (IQ2_XXS ``ffn_down``, Q2_K for its first eighth, Q8_0 for the tied embedding). The suite runs IQ4_XS and
IQ3_XXS with a matrix (27 and 32 CPU s: the costlier rules); the rest (IQ4_XS without one, IQ4_NL, IQ3_M, IQ3_S,
IQ3_XS, the IQ2 mixes) with ``RESUMERGE_TEST_EVERY_MIX=1`` (tests/test_gguf_iquants.py, tests/test_gguf_iq3.py and
tests/test_gguf_iq2.py check every mix on tiny models and the encoders on SmolLM2's rows; test_gguf_kquants_real.py
IQ4_XS on Gemma-3). The mixes with a matrix are written by one release run (the slice read and merged once for all
of them, and its F16 file beside them). Skipped where llama.cpp's library (the test-only oracle) does not load."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from encoderparity import one_baseline  # noqa: F401 (fixtures)
from llamacpp_oracle import Stored, quantize_model, tensors_of
from test_gguf_kquants_real import EVERY_MIX, _f16, _imatrix, _source, write_imatrix

from resumerge import api
from resumerge.merge.plan.gguftypes import MIXES

pytestmark = pytest.mark.slow


# SmolLM2's first 8 of its 30 layers: every tensor's shape and kind of row, the tied embedding, and every branch of
# the mixes' layer rules (the first eighth, llama.cpp's use_more_bits: layers 0, 3, 6 and 7), at 56 million weights
# instead of 134 million (each mix encodes and llama.cpp quantizes all of them).
LAYERS = 8
EIGHTH = LAYERS // 8  # the first eighth of ffn_down that some mixes write in a richer type


# The (mix, with a matrix) pairs of the tests below: the weighted ones written by one release run.
IQ4_CASES = [("iq4_xs", True), *((("iq4_xs", False), ("iq4_nl", False)) if EVERY_MIX else ())]
IQ3_CASES = [("iq3_xxs", True), *((("iq3_m", False), ("iq3_s", False), ("iq3_xs", True)) if EVERY_MIX else ())]
IQ2_CASES = [(mix, True) for mix in ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m") if EVERY_MIX]
WEIGHTED = tuple(mix for mix, matrix in (*IQ4_CASES, *IQ3_CASES, *IQ2_CASES) if matrix)


class Slice(NamedTuple):
    """SmolLM2's first LAYERS layers as one release run wrote them with an importance matrix: the config of the
    float16 passthrough merge, its F16 file (llama-quantize's input), the matrix (as llama-quantize passes it) and
    each WEIGHTED mix's file."""

    config: Path
    f16: Path
    imatrix: dict[str, np.ndarray]
    files: dict[str, Path]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Slice:
    """SmolLM2's GGUF fixture's first LAYERS layers merged once (float16 passthrough) and written by one release run
    with an importance matrix (positive values for every block matrix of the slice, named from the fixture's own) as
    the F16 file and every mix the tests check with a matrix."""
    root = tmp_path_factory.mktemp("smollm2")
    entries = _imatrix(_source("smollm2"), LAYERS)
    write_imatrix(root / "imatrix.gguf", entries)
    _, config, f16 = _f16("smollm2", LAYERS, root, WEIGHTED, root / "imatrix.gguf")
    return Slice(config, f16, entries, {mix: f16.with_name(f"model-{mix.upper()}.gguf") for mix in WEIGHTED})


def _written(mix: str, weighted: bool, smollm2: Slice, tmp_path: Path) -> dict[str, Stored]:
    """The ``mix`` file resumerge writes of SmolLM2 (with an importance matrix where ``weighted``: the file of
    :func:`smollm2`'s release), its every tensor's type and bytes checked equal to llama_model_quantize's on the F16
    file with the same matrix."""
    entries = None
    if weighted:
        entries, ours = smollm2.imatrix, smollm2.files[mix]
    else:
        api.run(smollm2.config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s",
                                                                        output=api.Output(out_type="gguf",
                                                                                          gguf_type=mix)))
        ours = tmp_path / "out" / "model.gguf"
    quantize_model(smollm2.f16, tmp_path / "llama.gguf", MIXES[mix].file_type, imatrix=entries)
    got, want = tensors_of(ours), tensors_of(tmp_path / "llama.gguf")
    assert got.keys() == want.keys()
    assert {n: got[n].kind for n in got} == {n: want[n].kind for n in want}
    assert [n for n in got if got[n] != want[n]] == []
    return got


@pytest.mark.parametrize(("mix", "weighted"), IQ4_CASES)
def test_each_iq4_mix_of_a_real_model_is_llama_quantize_s(mix: str, weighted: bool, smollm2: Slice,
                                                          tmp_path: Path) -> None:
    got = _written(mix, weighted, smollm2, tmp_path)
    down = [got[f"blk.{i}.ffn_down.weight"].kind for i in range(4)]
    if mix == "iq4_xs":  # the matrix changes the first eighth's type, not only its bytes
        assert down == ["IQ4_XS"] * 4 if weighted else down == ["Q5_K"] * EIGHTH + ["IQ4_XS"] * (4 - EIGHTH)
        assert got["blk.0.attn_q.weight"].kind == "IQ4_NL"  # 576 values a row: IQ4_XS's fallback


@pytest.mark.parametrize(("mix", "weighted"), IQ3_CASES)
def test_each_iq3_mix_of_a_real_model_is_llama_quantize_s(mix: str, weighted: bool, smollm2: Slice,
                                                          tmp_path: Path) -> None:
    """The IQ3 mixes: SmolLM2's 1536-wide ffn_down written by the IQ3 encoders (IQ3_M's first eighth Q4_K; IQ3_XXS's
    all IQ3_XXS with the matrix, which needs one), its 576-wide rows IQ4_NL (the fallback)."""
    got = _written(mix, weighted, smollm2, tmp_path)
    down = [got[f"blk.{i}.ffn_down.weight"].kind for i in range(4)]
    iq3_m = ["Q4_K"] * EIGHTH + ["IQ3_S"] * (4 - EIGHTH)
    assert down == (iq3_m if mix == "iq3_m" else ["IQ3_XXS"] * 4 if mix == "iq3_xxs" else down)
    assert got["blk.0.attn_q.weight"].kind == "IQ4_NL"


@pytest.mark.parametrize(("mix", "weighted"), IQ2_CASES)
def test_each_iq2_mix_of_a_real_model_is_llama_quantize_s(mix: str, weighted: bool, smollm2: Slice,
                                                          tmp_path: Path) -> None:
    """The IQ2 mixes (a matrix each, as llama-quantize needs), every tensor's type and bytes llama.cpp's: SmolLM2's
    576-wide rows IQ4_NL (the fallback), its tied embedding Q8_0 (rows not whole 256-value blocks); IQ2_XXS's
    1536-wide ffn_down IQ2_XXS but its first eighth's Q2_K."""
    got = _written(mix, weighted, smollm2, tmp_path)
    assert got["blk.0.attn_q.weight"].kind == "IQ4_NL"
    assert got["token_embd.weight"].kind == "Q8_0"
    if mix == "iq2_xxs":
        down = [got[f"blk.{i}.ffn_down.weight"].kind for i in range(4)]
        assert down == ["Q2_K"] * EIGHTH + ["IQ2_XXS"] * (4 - EIGHTH)
