"""Each K mix on real models (issue 84's check): SmolLM2-135M (llama, 576-wide rows, tied embeddings) and
Gemma-3-270M (gemma3: 640-wide rows, head dim 256, q/k norms, tied embeddings, a 262,144-token table) from their
GGUF fixtures, passed through resumerge to every ``--gguf-type`` K mix (one release run writes the F16 GGUF and the
mixes, another the F16 GGUF of the first layers and the mixes with an importance matrix: the model read and merged
once for each, the F16 file llama-quantize takes written beside resumerge's mixes): the type of every tensor
equals ``llama_model_quantize``'s for the mix on the F16 GGUF resumerge wrote of the same merge, and every tensor's
bytes are the same; with an importance matrix at q4_k_m, q2_k_s and iq4_xs. Skipped where llama.cpp's library (the
test-only oracle) does not load.

The whole sweep (both models, all nine mixes: ~12 minutes of two cores) runs with ``RESUMERGE_TEST_EVERY_MIX=1``; the
suite keeps Gemma-3 at q3_k_m (Q4_K and Q5_K beside each other under the mix's rules, its 640-wide rows in the fallbacks
Q4_0, Q5_0, Q5_1 and Q8_0), and the importance-matrix case at q4_k_m and q2_k_s (on the first 8 layers: 29 -> 15 CPU s
at q2_k_s), within its 15 minutes (SmolLM2's rows meet every K encoder, with and without a matrix, in
tests/test_gguf_kquants.py, which checks each mix on tiny models; Gemma-3 at q6_k, 10 CPU s of that Q6_K encoder on its
ffn_down and the Q8_0 fallback q3_k_m's table takes, and IQ4_XS with a matrix on it, 87 CPU s, with the sweep:
tests/test_gguf_iquants_real.py keeps IQ4_XS on SmolLM2).
Session 45 ran the whole sweep: 20 passed.

The 1-bit, ternary and MXFP4 mixes (issue 95) on the first layer of that sliced F16 file (its fixture shared): one
release run writes the F16 file and iq1_s with a matrix (iq1_m and tq2_0 too with the sweep), another tq1_0 without
(mxfp4_moe too), each file's every tensor llama_model_quantize's for the mix on that F16 file with the same matrix:
Gemma-3's 640-wide rows in those mixes' fallbacks (IQ4_NL and Q5_0 in a 1-bit file, Q4_0 in a ternary one, Q8_0 the
tied embedding). IQ1_S, IQ1_M, TQ1_0 and TQ2_0 encode its 1024- and 2048-wide rows, MXFP4 every matrix's, to
llama.cpp's bytes, compiled and on the numpy path (SmolLM2's rows and tiny models in tests/test_gguf_iq1.py,
test_gguf_tquants.py and test_gguf_mxfp4.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import encoderparity as parity
import gguf
import numpy as np
import pytest
import test_gguf_mxfp4
import test_gguf_tquants
from encoderparity import one_baseline  # noqa: F401 (fixtures)
from llamacpp_oracle import needs_library, quantize, quantize_model, tensors_of
from support import write_config
from test_gguf_iq2 import assert_llama_cpp_s

from resumerge import api
from resumerge.merge.plan.gguftypes import MIXES

EVERY_MIX = os.environ.get("RESUMERGE_TEST_EVERY_MIX") == "1"
K_MIXES = [mix for mix in MIXES if "_k" in mix and not MIXES[mix].needs_imatrix
           and (EVERY_MIX or mix == "q3_k_m")]
pytestmark = pytest.mark.slow


MODELS = ["smollm2", "gemma3"] if EVERY_MIX else ["gemma3"]
# The importance-matrix case on each model's first 8 layers: every tensor's shape and kind of row, the tied
# embedding, and every branch of those mixes' layer rules (q2_k_s's first eighth of ffn_down, q4_k_m's
# use_more_bits: layers 0, 3, 6 and 7), at less than half the blocks each side encodes. q3_k_m keeps every layer:
# its first sixteenth of ffn_down (Q5_K) needs 16 of them.
LAYERS = 8


def _source(model: str) -> Path:
    """The model's GGUF fixture (the test skipped where llama.cpp's library does not load)."""
    needs_library()
    from realmodel import gemma3_gguf, smollm2_gguf

    return smollm2_gguf() if model == "smollm2" else gemma3_gguf()


def _f16(model: str, layers: int | None, root: Path, mixes: tuple[str, ...] = (),
         imatrix: Path | None = None) -> tuple[str, Path, Path]:
    """(model, the config of a float16 passthrough merge of its GGUF fixture (its first ``layers`` layers; None:
    all), the F16 GGUF resumerge writes of it). Given ``mixes``, one release run writes those files beside it
    (``model-Q3_K_M.gguf``...), with the importance matrix ``imatrix`` where given: the model is read and merged once
    for all of them."""
    source = str(_source(model))
    merge = ({"models": [{"model": source}]} if layers is None
             else {"slices": [{"sources": [{"model": source, "layer_range": [0, layers]}]}]})
    config = write_config(root / "c.yml", {"merge_method": "passthrough", "dtype": "float16", **merge})
    api.run(config, root / "f16", settings=api.Settings(state_dir=root / "s", output=api.Output(
        out_type="gguf", gguf_type=",".join(("f16", *mixes)), imatrix=None if imatrix is None else str(imatrix))))
    return model, config, root / "f16" / ("model-F16.gguf" if mixes else "model.gguf")


@pytest.fixture(scope="module", params=MODELS)
def real_f16(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(model, the config of a float16 passthrough merge of its GGUF fixture, the F16 GGUF resumerge writes of it),
    each K_MIXES file written beside it by the same release run (``model-Q3_K_M.gguf``)."""
    return _f16(request.param, None, tmp_path_factory.mktemp(request.param), tuple(K_MIXES))


def _imatrix(f16: Path, layers: int | None = None) -> dict[str, np.ndarray]:
    """Positive importance values for every block matrix of the GGUF ``f16`` (of its first ``layers`` layers where
    given: those of a slice of it), as llama-quantize passes them."""
    rng = np.random.default_rng(5)
    return {name: (rng.random(t.ne[0]) * 4 + 0.01).astype(np.float32)  # the slice's tensors read, no vocabulary
            for name, t in tensors_of(f16, lambda name: name.startswith("blk.") and (
                layers is None or int(name.split(".")[1]) < layers)).items() if t.ne[1] > 1}


def write_imatrix(path: Path, entries: dict[str, np.ndarray]) -> None:
    """``entries`` as llama-imatrix's GGUF, each counted once (the sums are the values llama-quantize applies)."""
    parity.write_imatrix_gguf(path, {name: (values.reshape(1, -1), np.ones(1, dtype=np.float32))
                               for name, values in entries.items()})


@pytest.mark.parametrize("mix", K_MIXES)
def test_each_k_mix_of_a_real_model_is_llama_quantize_s(mix: str, real_f16: tuple[str, Path, Path],
                                                        tmp_path: Path) -> None:
    """The mix's file of the release that wrote the F16 one (the model read and merged once for every mix), every
    tensor's type and bytes llama_model_quantize's for the mix on that F16 file."""
    model, _, f16 = real_f16
    quantize_model(f16, tmp_path / "llama.gguf", MIXES[mix].file_type)
    got, want = tensors_of(f16.with_name(f"model-{mix.upper()}.gguf")), tensors_of(tmp_path / "llama.gguf")
    assert got.keys() == want.keys()
    assert {n: got[n].kind for n in got} == {n: want[n].kind for n in want}, model
    assert [n for n in got if got[n] != want[n]] == [], model
    # The mix is not the file's default type everywhere: the rules and the fallbacks were exercised.
    assert len({t.kind for t in got.values()}) >= 3


MATRIX_MIXES = ("q4_k_m", "q2_k_s", *(("iq4_xs",) if EVERY_MIX else ()))


class Weighted(NamedTuple):
    """The model, the F16 file of its first LAYERS layers, the importance matrix (as llama-quantize passes it) and
    each MATRIX_MIXES file the same release run wrote with it."""

    model: str
    f16: Path
    imatrix: dict[str, np.ndarray]
    files: dict[str, Path]


@pytest.fixture(scope="module", params=MODELS)
def weighted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Weighted:
    """The model's first LAYERS layers merged once and written by one release run with an importance matrix
    (positive values for every block matrix of the slice, named from the fixture's own) as the F16 file and every
    MATRIX_MIXES mix: the slice read and merged once for llama-quantize's input and resumerge's mixes."""
    model = request.param
    root = tmp_path_factory.mktemp(f"{model}-weighted")
    entries = _imatrix(_source(model), LAYERS)
    write_imatrix(root / "imatrix.gguf", entries)
    _, _, f16 = _f16(model, LAYERS, root, MATRIX_MIXES, root / "imatrix.gguf")
    return Weighted(model, f16, entries, {mix: f16.with_name(f"model-{mix.upper()}.gguf") for mix in MATRIX_MIXES})


@pytest.mark.parametrize("mix", MATRIX_MIXES)
def test_a_real_model_with_an_importance_matrix_is_llama_quantize_s(mix: str, weighted: Weighted,
                                                                    tmp_path: Path) -> None:
    """With a matrix, every tensor llama_model_quantize's; Q2_K_S (written only with one) and IQ4_XS (issue 95)
    too, on Gemma-3's 4 heads a KV head and its first LAYERS layers (their attn_v and ffn_down rules)."""
    model, f16, entries, files = weighted
    quantize_model(f16, tmp_path / "llama.gguf", MIXES[mix].file_type, imatrix=entries)
    got, want = tensors_of(files[mix]), tensors_of(tmp_path / "llama.gguf")
    assert [n for n in got if got[n] != want[n]] == [], model
    down = [got[f"blk.{i}.ffn_down.weight"].kind for i in range(LAYERS)]  # the slice still meets each layer rule
    if mix == "q2_k_s":
        assert down == ["Q4_K"] * (LAYERS // 8) + ["Q2_K"] * (LAYERS - LAYERS // 8)
    if mix == "q4_k_m":
        assert down == ["Q6_K" if i in (0, 3, 6, 7) else "Q4_K" for i in range(LAYERS)]
    if not MIXES[mix].needs_imatrix:  # the matrix changed the bytes: a block matrix's, as llama.cpp encodes it with
        # and without its row of the matrix (that tensor through ggml_quantize_chunk: not the model quantized again)
        name = "blk.0.ffn_down.weight"
        values = np.frombuffer(tensors_of(f16, name.__eq__)[name].data, dtype=np.float16).reshape(-1, got[name].ne[0])
        code = gguf.GGMLQuantizationType[got[name].kind].value
        assert quantize(values, code, entries[name]).tobytes() == got[name].data != quantize(values, code).tobytes()


# The 1-bit, ternary and MXFP4 mixes (issue 95) on one layer of weighted's F16: every kind of row the model has
# (Gemma-3's 640-wide fallbacks, attn_output's 1024 and ffn_down's 2048 values a row); the layer rules over depth (the
# first eighth of ffn_down) are checked on SmolLM2 and tiny models. The suite writes iq1_s with a matrix and tq1_0
# without (every fallback type these mixes take: IQ4_NL and Q5_0 weighted, Q4_0 plain); iq1_m, tq2_0 (the same
# fallbacks, their own encoders on Gemma-3's rows below) and mxfp4_moe (Q8_0 everywhere: Gemma-3 has no experts) with
# the sweep.
WEIGHTED = ("iq1_s", *(("iq1_m", "tq2_0") if EVERY_MIX else ()))
PLAIN = ("tq1_0", *(("mxfp4_moe",) if EVERY_MIX else ()))


class Release(NamedTuple):
    """The F16 file of the one-layer slice, the matrix the weighted files took, each mix's file, and the F16 file's
    block matrices (float32, by name)."""

    f16: Path
    imatrix: dict[str, np.ndarray]
    files: dict[str, Path]
    matrices: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def release(weighted: Weighted, tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The first layer of ``weighted``'s F16 file passed through resumerge as two releases: the F16 file and
    WEIGHTED with an importance matrix (positive values for layer 0's block matrices), PLAIN without."""
    model, sliced = weighted.model, weighted.f16
    root = tmp_path_factory.mktemp(f"{model}-lowbits")
    config = write_config(root / "c.yml", {"merge_method": "passthrough", "dtype": "float16", "slices": [
        {"sources": [{"model": str(sliced), "layer_range": [0, 1]}]}]})
    entries = _imatrix(sliced, 1)
    write_imatrix(root / "imatrix.gguf", entries)
    files = {}
    for out, mixes, imatrix in (("weighted", ("f16", *WEIGHTED), str(root / "imatrix.gguf")), ("plain", PLAIN, None)):
        api.run(config, root / out, settings=api.Settings(state_dir=root / f"{out}-state", output=api.Output(
            out_type="gguf", gguf_type=",".join(mixes), imatrix=imatrix)))
        files.update({mix: root / out / (f"model-{mix.upper()}.gguf" if len(mixes) > 1 else "model.gguf")
                      for mix in mixes})
    f16 = files.pop("f16")
    matrices = {name: np.frombuffer(t.data, dtype=np.float16).reshape(-1, t.ne[0]).astype(np.float32)
                for name, t in tensors_of(f16, lambda name: name.startswith("blk.0.")).items() if t.ne[1] > 1}
    return Release(f16, entries, files, matrices)


# The types each mix writes Gemma-3's rows in: 640-wide ones (attn_q, attn_v, ffn_up) fall back, ffn_down's keep
# the mix's type; none of Gemma-3's matrices is an expert stack, so MXFP4_MOE writes Q8_0 everywhere.
KINDS = {"iq1_s": ("IQ4_NL", "Q5_0", "IQ4_NL", "IQ1_S"), "iq1_m": ("IQ4_NL", "Q5_0", "IQ4_NL", "IQ1_M"),
         "tq1_0": ("Q4_0", "Q4_0", "Q4_0", "TQ1_0"), "tq2_0": ("Q4_0", "Q4_0", "Q4_0", "TQ2_0"),
         "mxfp4_moe": ("Q8_0",) * 4}


@pytest.mark.parametrize("mix", [*WEIGHTED, *PLAIN])
def test_each_low_bit_mix_of_gemma3_is_llama_quantize_s(mix: str, release: Release, tmp_path: Path) -> None:
    """Every tensor's type and bytes equal llama_model_quantize's for the mix on the same F16 file (with the same
    matrix for WEIGHTED): the fallbacks of rows not whole 256-value blocks as llama.cpp picks and encodes them."""
    quantize_model(release.f16, tmp_path / "llama.gguf", MIXES[mix].file_type,
                   imatrix=release.imatrix if mix in WEIGHTED else None)
    got, want = tensors_of(release.files[mix]), tensors_of(tmp_path / "llama.gguf")
    assert got.keys() == want.keys()
    assert {n: got[n].kind for n in got} == {n: want[n].kind for n in want}
    assert [n for n in got if got[n] != want[n]] == []
    if got["blk.0.attn_q.weight"].ne[0] == 640:  # Gemma-3 (SmolLM2's 576 too with RESUMERGE_TEST_EVERY_MIX=1)
        names = ("attn_q", "attn_v", "ffn_up", "ffn_down")
        assert tuple(got[f"blk.0.{name}.weight"].kind for name in names) == KINDS[mix]


def rows(release: Release, block: int, count: int) -> dict[str, np.ndarray]:
    """``count`` rows, spread over it, of each of layer 0's matrices whose rows are whole ``block``-value blocks
    (those a type of such blocks encodes; llama.cpp's quantizer refuses the others)."""
    return {name: values[:: max(1, values.shape[0] // count)][:count]
            for name, values in release.matrices.items() if values.shape[1] % block == 0}


@pytest.mark.parametrize("kind", ["IQ1_S", "IQ1_M"])
def test_each_iq1_encoder_writes_llama_cpp_s_bytes_on_gemma3_rows(kind: str, release: Release) -> None:
    """The rows of whole 256-value blocks (Gemma-3's attn_output, 1024 wide, and ffn_down, 2048) with their matrix
    (IQ1_M without one too), compiled and on the numpy path."""
    code = {"IQ1_S": 19, "IQ1_M": 29}[kind]
    taken = rows(release, 256, 8)
    assert "blk.0.ffn_down.weight" in taken
    for name, x in taken.items():
        assert_llama_cpp_s(x, code, release.imatrix[name], name)
        if kind == "IQ1_M":
            assert_llama_cpp_s(x, code, None, (name, "plain"))


@pytest.mark.parametrize("kind", ["TQ1_0", "TQ2_0", "MXFP4"])
def test_the_ternary_and_mxfp4_encoders_write_llama_cpp_s_bytes_on_gemma3_rows(
        kind: str, release: Release, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ternary types on the rows of whole 256-value blocks, MXFP4 on every matrix's (32-value blocks: Gemma-3's
    640-wide rows too), compiled and on the numpy path."""
    taken = rows(release, 32 if kind == "MXFP4" else 256, 32)
    assert len(taken) == (len(release.matrices) if kind == "MXFP4" else len(taken)) > 0
    for x in taken.values():
        if kind == "MXFP4":
            test_gguf_mxfp4.assert_llama_cpp_s(x, monkeypatch)
        else:
            test_gguf_tquants.assert_llama_cpp_s(x, {"TQ1_0": 34, "TQ2_0": 35}[kind], monkeypatch)
