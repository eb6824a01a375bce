"""GGUF's 1-bit i-quants written as llama.cpp writes them (issue 95): IQ1_S and IQ1_M byte-equal to
``ggml_quantize_chunk`` with an importance matrix (IQ1_M without one too) on awkward rows, exact ties as TIES/DARE
merges leave them, rows of zeros, zero importances and SmolLM2's rows; the order of equal values in each block's
sort (glibc's ``qsort``: stable) shown to matter and to be the library's; the numpy path (no numba) and the
uncompiled kernel to the compiled one's bytes; the grid and decoders against gguf-py's and llama.cpp's; the
IQ1_S and IQ1_M mixes' whole files against ``llama_model_quantize`` with a matrix, and refused in one line without
one. llama.cpp's own library is the oracle (tests/llamacpp_oracle.py); those tests skip where it does not load."""

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
from llamacpp_oracle import dequantize, library, needs_library, quantize
from support import cli
from test_gguf_iq2 import (  # the parity checks: encoders (compiled and numpy) and whole mixes, against llama.cpp
    assert_llama_cpp_s,
    assert_mix_with_a_matrix,
)

from resumerge import api
from resumerge.errors import UsageError
from resumerge.inputs.gguf import blocks, iq1blocks
from resumerge.merge.plan.gguftypes import MIXES, ModelFacts, TypeChoices, requires_imatrix, tensor_type
from resumerge.outputs.gguf import iq1loop, iq1quants, jit
from resumerge.outputs.gguf.iquants import encode_iq

IQ1 = {"IQ1_S": 19, "IQ1_M": 29}
F = np.float32


@pytest.mark.parametrize("kind", list(IQ1))
def test_each_iq1_encoder_writes_llama_cpp_s_bytes(kind: str) -> None:
    """Normal, bf16-exact, zero, constant, outlier, one-signed, tiny, ramp and few-valued rows
    (test_gguf_kquants.awkward), with a super-block of zero importances; IQ1_M without a matrix too."""
    needs_library()
    for seed in range(2):
        weights = parity.importance(1024, seed)
        weights[:256] *= F(seed)  # seed 0: a super-block of zero importances
        assert_llama_cpp_s(parity.awkward(16, 1024, seed), IQ1[kind], weights, seed)
    if kind == "IQ1_M":  # ggml's IQ1_M has weights (x²) without a matrix too
        assert_llama_cpp_s(parity.awkward(16, 512, 5), IQ1[kind], None, "plain")


@pytest.mark.parametrize("kind", list(IQ1))
def test_exact_ties_as_merges_make_them_are_llama_cpp_s(kind: str) -> None:
    """Zeros, copies and ±m (tests/test_gguf_iquants.py's ties), with equal importances over a stretch and tiny
    ones: the sort's equal values, the first of equal fits and of equal neighbour errors, as llama.cpp's."""
    needs_library()
    for seed in range(2):
        weights = parity.importance(768, seed)
        weights[100:400] = weights[100]
        assert_llama_cpp_s(parity.ties(seed), IQ1[kind], weights, seed)
        assert_llama_cpp_s(parity.ties(seed), IQ1[kind], weights * F(1e-30), (seed, "tiny"))
    if kind == "IQ1_M":
        assert_llama_cpp_s(parity.ties(2), IQ1[kind], None, "plain")


@pytest.mark.parametrize("kind", list(IQ1))
def test_the_order_of_equal_values_is_the_library_s(kind: str) -> None:
    """A block whose values are all equal sorts as a run of ties, and its prefix sums (of w·x, in the sorted
    order) round differently by the order of the different weights: shuffling the importances over the block
    changes the bytes llama.cpp writes, and for every shuffle ours are its. The order llama.cpp's ``qsort`` leaves
    equal values in is glibc's (a stable merge sort: index order), which the encoders take
    (resumerge.outputs.gguf.iq1loop's docstring: where another C library's could differ)."""
    needs_library()
    rng = np.random.default_rng(11)
    x = np.full((1, 256), F(0.375))
    base = parity.importance(256, 11)
    seen = set()
    for _ in range(8):
        weights = base.copy()
        for start in range(0, 256, 32):
            weights[start:start + 32] = rng.permutation(weights[start:start + 32])
        assert_llama_cpp_s(x, IQ1[kind], weights)
        seen.add(quantize(x, IQ1[kind], weights).tobytes())
    assert len(seen) > 1  # the order matters here: a sort that kept another order of ties would be caught


@pytest.mark.parametrize("kind", list(IQ1))
def test_each_iq1_encoder_writes_llama_cpp_s_bytes_on_real_weights(kind: str, real_rows: np.ndarray  # noqa: F811
                                                                   ) -> None:
    """SmolLM2-135M's rows (a slice of every matrix), with a matrix (IQ1_M without one too)."""
    needs_library()
    rows = real_rows[::16]
    assert_llama_cpp_s(rows, IQ1[kind], parity.importance(1536, 7), "imatrix")
    if kind == "IQ1_M":
        assert np.array_equal(encode_iq(rows, IQ1[kind], None), quantize(rows, IQ1[kind], None))


def test_the_numpy_path_and_the_plain_kernel_are_the_compiled_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without numba the numpy path (resumerge.outputs.gguf.iq1numpy) writes the compiled kernel's bytes, and so
    does the kernel run uncompiled (iq1loop.plain, the numpy path's reference), on ties, zeros and a super-block of
    zero importances, IQ1_M without a matrix too."""
    x, weights = parity.numpy_path_case()
    cases = [(code, weights) for code in IQ1.values()] + [(IQ1["IQ1_M"], None)]
    compiled = [encode_iq(x, code, w) for code, w in cases]
    parity.numpy_path_bytes(encode_iq, cases, x, compiled)
    monkeypatch.setattr(jit, "numba_module", lambda: None)
    monkeypatch.setattr(iq1loop, "kernels", lambda: iq1loop.plain)
    for (code, w), fast in zip(cases, compiled, strict=True):  # slow: about a second a super-block
        with np.errstate(all="ignore"):
            first = encode_iq(x[3:4, :256], code, None if w is None else w[:256])
            assert np.array_equal(first, fast[3:4, :fast.shape[1] // 2]), code


def test_iq1_s_needs_an_importance_matrix() -> None:
    with pytest.raises(ValueError, match="needs an importance matrix"):
        encode_iq(parity.awkward(16, 256, 0), IQ1["IQ1_S"], None)


def test_the_grid_and_decoders_are_gguf_py_s_and_llama_cpp_s() -> None:
    """The grid is gguf-py's (its grid_hex); every grid point is in the quantizer's map and every off-grid key has
    neighbours; random blocks decode to gguf-py's and llama.cpp's float32 bits."""
    assert iq1blocks.kgrid().tobytes() == bytes.fromhex(gguf.quants.IQ1_S.grid_hex.decode())
    grid, kmap, neighbours = iq1quants.tables()
    assert np.array_equal(kmap[iq1blocks.kgrid()], np.arange(2048))
    off = np.flatnonzero(kmap < 0)
    assert off.size and np.all(neighbours[-kmap[off] - 1] > 0)
    assert np.array_equal((grid.astype(np.int64) - 1) // 2, (iq1blocks.kgrid().astype(np.int64)[:, None]
                                                            >> (2 * np.arange(8))) & 3)
    for code, size in ((IQ1["IQ1_S"], 50), (IQ1["IQ1_M"], 56)):
        rng = np.random.default_rng(code)
        raw = rng.integers(0, 256, (64, size), dtype=np.uint8)
        if code == IQ1["IQ1_S"]:
            raw[:, 0:2] = np.frombuffer(rng.normal(size=64).astype(np.float16).tobytes(), np.uint8).reshape(64, 2)
        else:
            raw[:, 55] &= 0x3F  # a finite float16 d (its top nibble in the last scale word)
        want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(code)).astype(F).reshape(64, 256)
        got = blocks.decode(torch.from_numpy(raw.reshape(4, -1)), code).numpy().reshape(64, 256)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), code
        if library() is not None:
            assert np.array_equal(got.view(np.uint32), dequantize(raw, code).reshape(64, 256).view(np.uint32))


def test_what_the_encoder_writes_decodes_near_the_values() -> None:
    """A round trip: IQ1_M of Gaussian rows decodes within its 1.75 bits' error (a check of the layout's order)."""
    x = np.random.default_rng(3).standard_normal((16, 512)).astype(F)
    for code in IQ1.values():
        decoded = blocks.decode(torch.from_numpy(encode_iq(x, code, parity.importance(512, 3))), code).numpy()
        assert np.linalg.norm(decoded - x) < 0.75 * np.linalg.norm(x), code


@pytest.mark.parametrize("mix", ["iq1_s", "iq1_m"])
def test_each_iq1_mix_is_llama_quantize_s_with_a_matrix(tmp_path: Path, mix: str,
                                                        merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                        ) -> None:
    """Every tensor's type and bytes equal llama_model_quantize's for the mix, with the same importance matrix."""
    assert_mix_with_a_matrix(tmp_path, mix, merges)


@pytest.mark.parametrize("mix", ["iq1_s", "iq1_m"])
def test_an_iq1_mix_without_a_matrix_is_refused_before_any_work(mix: str, tmp_path: Path,
                                                                merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                                ) -> None:
    config, _ = merges["llama"]
    with pytest.raises(UsageError, match="only with an importance matrix"):
        api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type=mix)))
    out = tmp_path / "out"
    done = cli("run", config, out, "--state-dir", tmp_path / "s", "--out-type", "gguf", "--gguf-type", mix)
    assert done.returncode == 2 and "only with an importance matrix" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists() and not (tmp_path / "s").exists()


def test_the_iq1_mixes_rules() -> None:
    """llama.cpp's 1-bit mixes share the 2-bit branch, attn_output apart: IQ2_XXS (Q5_K with 8 experts); attn_v
    Q2_K (Q4_K with 4+ heads a KV head); the first eighth of ffn_down Q2_K; output Q5_K; token_embd Q2_K; a row
    not whole 256-value blocks IQ4_NL; a 1-bit type needs a matrix, token_embd and output apart. (Every shape
    against llama.cpp's own choice: test_gguf_iquants.py's test_every_mix_s_types_are_llama_cpp_s_on_every_shape.)"""
    model = ModelFacts(layers=16, gqa=2)
    for mix in ("iq1_s", "iq1_m"):
        default = MIXES[mix].default
        assert tensor_type("blk.3.attn_output.weight", (512, 512), mix, model, TypeChoices(imatrix=True)).llama == 16
        assert tensor_type("blk.3.attn_output.weight", (512, 512), mix, ModelFacts(layers=16, experts=8)).llama == 13
        assert tensor_type("blk.3.attn_v.weight", (256, 512), mix, model).llama == 10
        assert tensor_type("blk.3.attn_v.weight", (256, 512), mix, ModelFacts(layers=16, gqa=4)).llama == 12
        assert tensor_type("blk.1.ffn_down.weight", (512, 1024), mix, model).llama == 10
        assert tensor_type("blk.2.ffn_down.weight", (512, 1024), mix, model).llama == default
        assert tensor_type("output.weight", (100, 512), mix, model).llama == 13
        assert tensor_type("token_embd.weight", (100, 512), mix, model).llama == 10
        assert tensor_type("blk.2.attn_q.weight", (512, 576), mix, model).llama == 20  # IQ4_NL: rows of 576
        assert requires_imatrix("blk.2.ffn_up.weight", default, "q4_k_m")
        assert not requires_imatrix("output.weight", default, mix)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(data=st.data(), kind=st.sampled_from(list(IQ1)), weighted=st.booleans())
def test_compiled_is_numpy_on_any_moderate_rows(data: st.DataObject, kind: str, weighted: bool) -> None:
    """Without llama.cpp's library too: the compiled kernel's bytes are the numpy path's on any values within ±1e6
    (and few distinct ones: ties, flat and zero blocks) and any importance within 0 ... 1e6."""
    if iq1loop.kernels() is None:
        pytest.skip("numba is not installed")
    x, w = parity.moderate_row(data)
    fast, slow = parity.both_paths(encode_iq, x, IQ1[kind], w if weighted or kind == "IQ1_S" else None)
    assert np.array_equal(fast, slow)


@pytest.mark.parametrize("mix", ["iq1_s", "iq1_m"])
def test_a_row_not_whole_super_blocks_falls_back_to_llama_cpp_s_iq4_nl(mix: str) -> None:
    """A tensor whose rows are not whole 256-value blocks (SmolLM2's 576) takes IQ4_NL in a 1-bit file, as
    llama.cpp's tensor_type_fallback picks it, and its bytes with the matrix are llama.cpp's."""
    needs_library()
    picked = tensor_type("blk.2.ffn_up.weight", (64, 576), mix, ModelFacts(layers=16), TypeChoices(imatrix=True))
    assert picked.llama == picked.written == 20
    x, weights = parity.awkward(16, 576, 3), parity.importance(576, 3)
    assert np.array_equal(encode_iq(x, picked.written, weights), quantize(x, picked.written, weights))
