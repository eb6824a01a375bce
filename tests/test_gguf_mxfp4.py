"""GGUF's MXFP4 written as llama.cpp writes it (issue 95): byte-equal to ``ggml_quantize_chunk`` on awkward rows,
merges' ties, the nearest-code ties (to the smaller magnitude, never -0), the exponent's edges (a binade's largest
floats, whose log2f rounds up; blocks under 2^-125, whose exponent wraps), any finite row and real weights; decoded
as llama.cpp and gguf-py decode it (every E8M0 byte); the mxfp4_moe mix's whole file equal to
``llama_model_quantize``'s on a model whose experts are stacks (qwen3moe) and on Mixtral checkpoints saved expert by
expert. llama.cpp's library is the oracle (tests/llamacpp_oracle.py); those tests skip where it does not load."""

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
from support import write_config
from test_gguf_iquants import finite_row

from resumerge import api
from resumerge.inputs.gguf import blocks
from resumerge.merge.plan.gguftypes import MIXES, ModelFacts, tensor_type
from resumerge.outputs.gguf import jit, mxfp4quants, tqmxloop
from resumerge.outputs.gguf.mxfp4quants import encode_mxfp4

MXFP4 = 39
F = np.float32


def both_paths(x: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    """``encode_mxfp4``'s bytes as taken here (compiled where numba is) and without numba (the numpy path)."""
    fast = encode_mxfp4(x)
    with monkeypatch.context() as patched:
        patched.setattr(jit, "numba_module", lambda: None)
        slow = encode_mxfp4(x)
    return fast, slow


def assert_llama_cpp_s(x: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = quantize(x, MXFP4)
    for path, ours in zip(("compiled", "numpy"), both_paths(x, monkeypatch), strict=True):
        assert np.array_equal(ours, theirs), (path, np.argwhere(ours != theirs)[:5].tolist())


def edges() -> np.ndarray:
    """Rows at the encoder's edges: each binade's largest floats (log2f rounds them up to the next exponent),
    powers of two, blocks under 2^-125 down to the smallest subnormal, float32's largest, values exactly halfway
    between two codes of both signs, and signed zeros."""
    x = np.zeros((4, 1280), dtype=F)
    top = np.nextafter(F(1), F(0))  # 1 - 2^-24
    for k in range(-40, 40):  # block k + 40: a ramp up to 2^k * top, then 2^k
        x[0, 16 * (k + 40):16 * (k + 41)] = np.ldexp(top, k) * np.linspace(-1, 1, 16, dtype=F)
        x[1, 16 * (k + 40):16 * (k + 41)] = np.ldexp(F(1), k) * np.linspace(1, -1, 16, dtype=F)
    for b, tiny in enumerate((F(2.0**-126), F(2.0**-125), F(3e-39), F(1e-44), F(1e-45), F(3.4e38))):
        x[2, 32 * b:32 * (b + 1)] = tiny * np.linspace(-1, 1, 32, dtype=F)
    # amax 6 (e 129, d 1): every midpoint of the doubled E2M1 values 0 1 2 3 4 6 8 12, of both signs
    mids = np.array([0.5, 1.5, 2.5, 3.5, 5, 7, 10, 6, 0.25, 0.75, 1.25, 1.75, 2.25, 4.5, 5.5, 0.1], dtype=F) / 2
    x[3, :32] = np.concatenate([mids, -mids])
    x[3, 32:64] = np.where(np.arange(32) % 2 == 0, F(-0.0), F(0.0))
    x[3, 64:96] = F(-0.0)
    return x


def test_the_mxfp4_encoder_writes_llama_cpp_s_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Awkward rows, merges' ties and zeros, the edges, compiled and numpy; an importance matrix changes nothing
    (llama.cpp's quantizer reads none for MXFP4)."""
    needs_library()
    for x in (parity.awkward(16, 1024, 0), parity.ties(1), edges()):
        assert_llama_cpp_s(x, monkeypatch)
        assert np.array_equal(encode_mxfp4(x, MXFP4, parity.importance(x.shape[1], 2)), quantize(x, MXFP4))


def test_the_mxfp4_encoder_writes_llama_cpp_s_bytes_on_real_weights(real_rows: np.ndarray,  # noqa: F811
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    needs_library()
    assert_llama_cpp_s(real_rows, monkeypatch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_finite_row_is_llama_cpp_s(data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernel's bytes are the numpy path's on any finite values, and llama.cpp's where it loads."""
    x, _ = finite_row(data, False)
    fast, slow = both_paths(x, monkeypatch)
    assert np.array_equal(fast, slow)
    if library() is not None:
        assert np.array_equal(fast, quantize(x, MXFP4))


def test_the_compiled_kernel_is_taken_with_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    parity.compiled_only(monkeypatch, tqmxloop.kernels, mxfp4quants, "_codes")
    encode_mxfp4(parity.awkward(12, 512, 2))


def test_mxfp4_decodes_as_llama_cpp_and_gguf_py_decode_it() -> None:
    """The input side decodes MXFP4 with torch to llama.cpp's own values and gguf-py's: on encodings, and on every
    E8M0 byte with random codes (255 is 2^127 there, where gpt-oss's MXFP4 has NaN)."""
    needs_library()
    noise = np.random.default_rng(0).integers(0, 256, (256, 17), dtype=np.uint8)
    noise[:, 0] = np.arange(256)
    for stored in (encode_mxfp4(parity.awkward(16, 512, 1)), encode_mxfp4(edges()), noise.reshape(16, -1)):
        ours = blocks.decode(torch.from_numpy(stored), MXFP4).numpy()
        assert np.array_equal(ours, dequantize(stored, MXFP4))
        with np.errstate(over="ignore"):  # 12 * 2^127 is inf on every side
            theirs = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType.MXFP4)
        assert np.array_equal(ours, theirs)


def test_the_mxfp4_moe_mix_s_types_are_llama_cpp_s() -> None:
    """A stack of more than one expert MXFP4 (whole, or an expert's slice of ``*_exps``), every other matrix Q8_0
    (token_embd and output.weight too), whatever the layer; --pure: MXFP4 everywhere."""
    from resumerge.merge.plan.gguftypes import TypeChoices

    model = ModelFacts(layers=4, experts=8)
    mix = "mxfp4_moe"
    assert tensor_type("blk.0.ffn_down_exps.weight", (8, 64, 128), mix, model).llama == MXFP4
    assert tensor_type("blk.0.ffn_up_exps.weight", (64, 128), mix, model).llama == MXFP4  # an expert's slice
    assert tensor_type("blk.0.ffn_up_exps.weight", (1, 64, 128), mix, model).llama == 8
    for name in ("token_embd.weight", "output.weight", "blk.0.attn_v.weight", "blk.3.ffn_down_shexp.weight",
                 "blk.1.attn_output.weight", "blk.0.ffn_down.weight"):
        assert tensor_type(name, (64, 128), mix, model).llama == 8, name
    assert tensor_type("blk.0.attn_q.weight", (64, 128), mix, model, TypeChoices(pure=True)).llama == MXFP4


def test_the_mxfp4_moe_mix_is_llama_quantize_s_on_stacked_experts(
        tmp_path: Path, merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    """qwen3moe's experts are stacks (3-D) in its GGUF parents: every tensor's type and bytes equal
    llama_model_quantize's MXFP4_MOE of the F16 file resumerge wrote of the same merge."""
    needs_library()
    config, f16 = merges["qwen3moe"]
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="mxfp4_moe")))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["mxfp4_moe"].file_type)
    parity.same_as_llama_quantize(tmp_path / "out" / "model.gguf", tmp_path / "llama.gguf")
    assert {t for t, _ in parity.stored_tensors(tmp_path / "out" / "model.gguf").values()} == {0, 8, MXFP4}


@pytest.mark.slow
def test_the_mxfp4_moe_mix_is_llama_quantize_s_on_mixtral_experts_one_by_one(tmp_path: Path) -> None:
    """transformers saves Mixtral's experts one by one: each is written MXFP4 as its slice of a stack, and the
    file equals llama_model_quantize's MXFP4_MOE of the F16 file of the same (float16) merge."""
    needs_library()
    from test_gguf_moe import mixtral_pair

    paths = mixtral_pair(tmp_path)
    merge = write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float16",
                                              "models": [{"model": str(p), "parameters": {"weight": 0.5}}
                                                         for p in paths]})
    api.run(merge, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="f16,mxfp4_moe")))  # a release: one merge, both files
    quantize_model(tmp_path / "out" / "model-F16.gguf", tmp_path / "llama.gguf", MIXES["mxfp4_moe"].file_type)
    parity.same_as_llama_quantize(tmp_path / "out" / "model-MXFP4_MOE.gguf", tmp_path / "llama.gguf")
    types = {n: t for n, (t, _) in parity.stored_tensors(tmp_path / "out" / "model-MXFP4_MOE.gguf").items()}
    assert types["blk.0.ffn_gate_exps.weight"] == MXFP4 and types["blk.0.attn_q.weight"] == 8


def test_an_mxfp4_moe_gguf_is_read_back_as_a_parent(tmp_path: Path, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                    ) -> None:
    """An MXFP4_MOE file resumerge wrote, merged again (passthrough to float32 safetensors): each expert of an
    MXFP4 stack read back with torch's decoder to gguf-py's values of its stored blocks."""
    from test_gguf_tquants import read_back

    read, want = read_back(tmp_path, merges["qwen3moe"][0], "mxfp4_moe", "blk.1.ffn_down_exps.weight")
    experts = [read[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].numpy() for e in range(want.shape[0])]
    assert np.array_equal(np.stack(experts), want)
