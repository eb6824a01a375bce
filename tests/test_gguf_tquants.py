"""GGUF's ternary types written as llama.cpp writes them (issue 95): TQ1_0 and TQ2_0 byte-equal to
``ggml_quantize_chunk`` on awkward rows, merges' exact ties, ternary tensors (kept exactly), any finite row and real
weights; decoded as llama.cpp and gguf-py decode them; the tq1_0 and tq2_0 mixes' whole files equal to
``llama_model_quantize``'s (token_embd Q4_K, the rows that are not whole super-blocks Q4_0), with the plan's note
that a tensor which is not ternary is rounded to ternary as llama.cpp's quantizer rounds it. llama.cpp's library is
the oracle (tests/llamacpp_oracle.py); those tests skip where it does not load."""

from __future__ import annotations

from pathlib import Path

import encoderparity as parity
import gguf
import numpy as np
import pytest
import torch
from encoderparity import merges, one_baseline, real_rows  # noqa: F401 (fixtures)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llamacpp_oracle import dequantize, library, needs_library, quantize, quantize_model
from test_gguf_iquants import finite_row

from resumerge import api
from resumerge.inputs.gguf import blocks
from resumerge.inputs.gguf.ggmltypes import TYPES
from resumerge.merge.plan.gguftypes import MIXES, ModelFacts, tensor_type
from resumerge.outputs.gguf import jit, tqmxloop, tquants
from resumerge.outputs.gguf.tquants import NOT_TERNARY, encode_tq

TQ_TYPES = {"TQ1_0": 34, "TQ2_0": 35}
F = np.float32


def both_paths(x: np.ndarray, code: int, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    """``encode_tq``'s bytes as taken here (compiled where numba is) and without numba (the numpy path)."""
    fast = encode_tq(x, code)
    with monkeypatch.context() as patched:
        patched.setattr(jit, "numba_module", lambda: None)
        slow = encode_tq(x, code)
    return fast, slow


def assert_llama_cpp_s(x: np.ndarray, code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = quantize(x, code)
    for path, ours in zip(("compiled", "numpy"), both_paths(x, code, monkeypatch), strict=True):
        assert np.array_equal(ours, theirs), (path, np.argwhere(ours != theirs)[:5].tolist())


def ternary(rows: int, seed: int) -> np.ndarray:
    """A BitNet-like tensor: each super-block's values -d, 0 or d (d float16-exact, one a block)."""
    rng = np.random.default_rng(seed)
    d = np.float16(rng.random((rows, 4, 1)) + 0.01).astype(F)
    return (rng.integers(-1, 2, (rows, 4, 256)).astype(F) * d).reshape(rows, 1024)


def halves(seed: int) -> np.ndarray:
    """Values at exactly half a power-of-two block maximum, of both signs (lroundf's ties: away from zero), and just
    under it."""
    x = parity.ties(seed)[:, :512].copy()
    x[0, :256] = np.where(np.arange(256) % 3 == 0, F(0.5), F(-0.5))
    x[0, 7] = F(1)
    x[1, :256] = np.where(np.arange(256) % 2 == 0, np.nextafter(F(0.25), F(0)), F(-0.25))
    x[1, 9] = F(-0.5)
    return x


@pytest.mark.parametrize("kind", list(TQ_TYPES))
def test_each_tq_encoder_writes_llama_cpp_s_bytes(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On awkward rows, merges' ties and zeros, lroundf's halves and ternary tensors, compiled and numpy: llama.cpp's
    bytes; an importance matrix changes nothing (llama.cpp's quantizer reads none for these types)."""
    needs_library()
    code = TQ_TYPES[kind]
    for x in (parity.awkward(16, 1024, 0), parity.ties(1)[:, :512], halves(2), ternary(4, 3)):
        assert_llama_cpp_s(x, code, monkeypatch)
        assert np.array_equal(encode_tq(x, code, parity.importance(x.shape[1], 1)), quantize(x, code))


@pytest.mark.parametrize("kind", list(TQ_TYPES))
def test_each_tq_encoder_writes_llama_cpp_s_bytes_on_real_weights(kind: str, real_rows: np.ndarray,  # noqa: F811
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    needs_library()
    assert_llama_cpp_s(real_rows, TQ_TYPES[kind], monkeypatch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(list(TQ_TYPES)))
def test_any_finite_row_is_llama_cpp_s(data: st.DataObject, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any finite values, few distinct ones and float32's ends included: the compiled kernel's bytes are the numpy
    path's, and llama.cpp's where its library loads."""
    x, _ = finite_row(data, False)
    fast, slow = both_paths(x, TQ_TYPES[kind], monkeypatch)
    assert np.array_equal(fast, slow)
    if library() is not None:
        assert np.array_equal(fast, quantize(x, TQ_TYPES[kind]))


def test_the_compiled_kernel_is_taken_with_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """With numba the compiled kernel encodes (the numpy path never runs); without, the numpy path (the tests above
    compare both with llama.cpp)."""
    parity.compiled_only(monkeypatch, tqmxloop.kernels, tquants, "_trits")
    for code in TQ_TYPES.values():
        encode_tq(parity.awkward(12, 512, 2), code)


@pytest.mark.parametrize("kind", list(TQ_TYPES))
def test_each_tq_type_decodes_as_llama_cpp_and_gguf_py_decode_it(kind: str) -> None:
    """The input side decodes TQ1_0 and TQ2_0 with torch to llama.cpp's own values and gguf-py's, on encodings and on
    random bytes (trits and packed bytes that no encoder writes); a ternary tensor comes back exactly."""
    needs_library()
    code = TQ_TYPES[kind]
    size = TYPES[code].size
    noise = np.random.default_rng(0).integers(0, 256, (64, size), dtype=np.uint8)
    noise[:, -2:] = np.array([0.5], dtype=np.float16).view(np.uint8)  # a finite d
    exact = ternary(8, 1)
    for stored in (encode_tq(parity.awkward(16, 512, 1), code), noise.reshape(16, -1), encode_tq(exact, code)):
        ours = blocks.decode(torch.from_numpy(stored), code).numpy()
        assert np.array_equal(ours, dequantize(stored, code))
        assert np.array_equal(ours, gguf.quants.dequantize(stored, gguf.GGMLQuantizationType(code)))
    assert np.array_equal(blocks.decode(torch.from_numpy(encode_tq(exact, code)), code).numpy(), exact)


def test_the_ternary_mixes_types_are_llama_cpp_s() -> None:
    """token_embd (untied) Q4_K, output.weight Q6_K (Q8_0 on rows not whole super-blocks), a row not whole
    super-blocks Q4_0, every other matrix the mix's type; 8 experts' attn_v and attn_k Q8_0 (llama.cpp's rule for
    every mix)."""
    model = ModelFacts(layers=4)
    for mix, code in (("tq1_0", 34), ("tq2_0", 35)):
        assert tensor_type("token_embd.weight", (1000, 512), mix, model).llama == 12
        assert tensor_type("output.weight", (1000, 512), mix, model).llama == 14
        assert tensor_type("output.weight", (1000, 576), mix, model).llama == 8
        assert tensor_type("token_embd.weight", (1000, 512), mix, ModelFacts(tied=True)).llama == 14
        assert tensor_type("blk.0.attn_q.weight", (512, 576), mix, model).llama == 2
        for name in ("blk.0.attn_v.weight", "blk.3.ffn_down.weight", "blk.1.attn_output.weight"):
            assert tensor_type(name, (512, 512), mix, model).llama == code
        assert tensor_type("blk.0.attn_v.weight", (512, 512), mix, ModelFacts(experts=8)).llama == 8


@pytest.mark.parametrize(("arch", "mix", "imatrix"), [("llama", "tq1_0", False), ("llama", "tq2_0", True),
                                                     ("qwen3moe", "tq1_0", False)])
def test_each_ternary_mix_is_llama_quantize_s_on_the_same_f16_file(
        tmp_path: Path, arch: str, mix: str, imatrix: bool, merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    """Every tensor's type and bytes equal llama_model_quantize's for the mix on the F16 file resumerge wrote of the
    same merge (which is not ternary: an average of two normal models, rounded as llama.cpp rounds it), with an
    importance matrix too (it weights the K-quant head and token_embd, not the ternary tensors); the plan says a
    tensor that is not ternary is rounded so."""
    needs_library()
    config, f16 = merges[arch]
    entries = None
    if imatrix:
        raw = parity.imatrix_entries(f16, 3)
        parity.write_imatrix_gguf(tmp_path / "imatrix.gguf", raw)
        entries = parity.as_llama_quantize_takes_it(raw)
    output = api.Output(out_type="gguf", gguf_type=mix, imatrix=str(tmp_path / "imatrix.gguf") if imatrix else None)
    assert NOT_TERNARY in api.plan_merge(config, settings=api.Settings(output=output)).notes
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=output))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES[mix].file_type, imatrix=entries)
    parity.same_as_llama_quantize(tmp_path / "out" / "model.gguf", tmp_path / "llama.gguf")
    assert TQ_TYPES[mix.upper()] in {t for t, _ in parity.stored_tensors(tmp_path / "out" / "model.gguf").values()}
    if imatrix:  # the matrix is used by the K-quant head (Q6_K) and token_embd (Q4_K) only
        quantize_model(f16, tmp_path / "plain.gguf", MIXES[mix].file_type)
        weighted = parity.stored_tensors(tmp_path / "out" / "model.gguf")
        plain = parity.stored_tensors(tmp_path / "plain.gguf")
        assert {n for n in plain if weighted[n] != plain[n]} == {"output.weight", "token_embd.weight"}


def test_texts_for_the_matrix_are_taken_by_the_ternary_mixes_and_refused_by_mxfp4_moe(
        tmp_path: Path, merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    """A ternary file's K-quant head and token_embd read an importance matrix (as llama-quantize's with --imatrix),
    so ``--imatrix-texts`` computes one for tq1_0 and tq2_0 (it was refused: "takes no importance matrix", the
    ternary default reads none); MXFP4_MOE's Q8_0 and MXFP4 read none: refused in one line, nothing written."""
    from support import cli

    config, _ = merges["llama"]
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat.\ntwo plus two is four.\n")
    for mix in ("tq1_0", "tq2_0"):  # the guard is the API's (the CLI's plan makes this one call): in this process
        plan = api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type=mix,
                                                                           imatrix_texts=texts)))
        assert MIXES[mix].default in {getattr(tp.out_codec, "ggml_type", None) for tp in plan.tensors.values()}
    refused = cli("run", config, tmp_path / "out", "--state-dir", tmp_path / "s", "--out-type", "gguf",
                  "--gguf-type", "mxfp4_moe", "--imatrix-texts", texts)
    assert refused.returncode == 2 and "takes no importance matrix" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def read_back(tmp_path: Path, config: Path, mix: str, name: str) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """The ``mix`` GGUF of ``config`` merged again (passthrough to float32 safetensors, its tensors returned), and
    gguf-py's values of its stored tensor ``name``."""
    read, stored = parity.read_back(tmp_path, config, mix)
    assert stored[name].tensor_type == MIXES[mix].default
    return read, parity.stored_values(stored[name])


def test_a_tq1_0_gguf_is_read_back_as_a_parent(tmp_path: Path, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                               ) -> None:
    """A TQ1_0 file resumerge wrote, merged again (passthrough to float32 safetensors): its ternary matrices read
    back with torch's decoder to gguf-py's values of the stored blocks."""
    read, want = read_back(tmp_path, merges["llama"][0], "tq1_0", "blk.1.ffn_down.weight")
    assert np.array_equal(read["model.layers.1.mlp.down_proj.weight"].numpy(), want)
