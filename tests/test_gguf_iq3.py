"""GGUF's 3-bit i-quants written as llama.cpp writes them (issue 95): IQ3_XXS and IQ3_S byte-equal to
``ggml_quantize_chunk`` with and without an importance matrix, on awkward rows, exact ties and empty blocks (the
zeros TIES/DARE merges leave: IQ3_S's empty block does not move the next one's codes), float32's ends and real
weights, the compiled kernel to the numpy path's bits; their grids and decoders equal to llama.cpp's own
dequantizer; the IQ3_XXS, IQ3_XS, IQ3_S and IQ3_M mixes' whole files equal to ``llama_model_quantize``'s (with a
matrix, which changes IQ3_XXS's types, and whose attn_q/attn_k are IQ2_S), IQ3_XXS and IQ3_XS refused without one
in one line. llama.cpp's library is the oracle
(tests/llamacpp_oracle.py); those tests skip where it does not load."""

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
from llamacpp_oracle import dequantize, needs_library, quantize
from support import cli_here
from test_gguf_iquants import finite_row

from resumerge import api
from resumerge.inputs.gguf import blocks, ggmltypes, iq3grid
from resumerge.merge.plan.gguftypes import ModelFacts, TypeChoices, tensor_type
from resumerge.outputs.gguf import iq3loop, iq3quants
from resumerge.outputs.gguf.iq3quants import encode_iq3

I3_TYPES = {"IQ3_XXS": 18, "IQ3_S": 21}
F = np.float32


def both_paths(x: np.ndarray, code: int, weights: np.ndarray | None,
               monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    """``encode_iq3``'s bytes as taken here (compiled where numba is) and without numba (the numpy path)."""
    return parity.both_paths(encode_iq3, x, code, weights)


def assert_llama_cpp_s(x: np.ndarray, code: int, weights: np.ndarray | None, monkeypatch: pytest.MonkeyPatch,
                       label: object = "") -> None:
    parity.assert_encoder_is_llama_cpp_s(encode_iq3, x, code, weights, label)


@pytest.mark.parametrize("size", [256, 512])
def test_the_grids_are_llama_cpp_s(size: int) -> None:
    """Each grid point decoded by llama.cpp's own dequantizer (a block of 64 indices, d 1, scale 0, no signs) is
    the point of :mod:`resumerge.inputs.gguf.iq3grid` (IQ3_XXS's magnitudes 4(2l + 1), its top one 62)."""
    needs_library()
    code, magnitudes = (18, iq3grid.XXS_MAGNITUDES) if size == 256 else (21, iq3grid.S_MAGNITUDES)
    stored = np.zeros((size // 64, ggmltypes.TYPES[code].size), dtype=np.uint8)
    stored[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    index = np.arange(size).reshape(-1, 64)
    stored[:, 2:66] = index & 255
    if code == 21:  # the ninth bit of index k of block j: bit k of qh[j]
        high = (index >> 8).reshape(-1, 8, 8) << np.arange(8)
        stored[:, 66:74] = high.sum(axis=2)
    scale = 0.25 if code == 18 else 1.0  # d * (0.5 + 0) * 0.5, d * (1 + 2 * 0)
    theirs = dequantize(stored, code).reshape(size, 4) / scale
    assert np.array_equal(theirs, np.array(magnitudes, dtype=F)[iq3grid.levels(size)])


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(I3_TYPES))
def test_each_iq3_encoder_writes_llama_cpp_s_bytes(kind: str, weighted: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    needs_library()
    for seed in range(2):
        x = parity.awkward(16, 1024, seed)
        assert_llama_cpp_s(x, I3_TYPES[kind], parity.importance(1024, seed) if weighted else None, monkeypatch, seed)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(I3_TYPES))
def test_exact_ties_and_empty_blocks_as_merges_make_them_are_llama_cpp_s(kind: str, weighted: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Many values exactly equal (zeros, copies, ±m), whole 32-value blocks of zeros at every place of a
    super-block (IQ3_S writes the next block's codes and signs where the empty one's would have gone), blocks
    under IQ3_XXS's 1e-8, and equal weights: llama.cpp's bytes."""
    needs_library()
    for seed in range(2):
        x = parity.ties(seed)
        x[0, 32:64] = 0
        x[1, 0:32] = 0
        x[1, 224:256] = 0
        x[2, 256 + 96:256 + 192] = 0
        x[3, 64:96] = F(3e-9)
        weights = parity.importance(768, seed) if weighted else None
        if weights is not None:
            weights[100:400] = weights[100]
        assert_llama_cpp_s(x, I3_TYPES[kind], weights, monkeypatch, seed)


@pytest.mark.parametrize("kind", list(I3_TYPES))
def test_each_iq3_encoder_writes_llama_cpp_s_bytes_on_real_weights(kind: str, real_rows: np.ndarray  # noqa: F811
                                                                   ) -> None:
    """Every row compiled; every eighth through the numpy path too (its cost, not its bytes, is the reason), to
    llama.cpp's bytes of those rows (its quantizer's rows are independent: one call serves both checks)."""
    needs_library()
    for weights in (None, parity.importance(1536, 7)):
        theirs = quantize(real_rows, I3_TYPES[kind], weights)
        assert np.array_equal(encode_iq3(real_rows, I3_TYPES[kind], weights), theirs), weights is None
        parity.numpy_path_bytes(encode_iq3, [(I3_TYPES[kind], weights)], real_rows[::8], [theirs[::8]])


def test_a_row_split_across_chunks_keeps_each_block_s_importance() -> None:
    """Rows longer than a chunk of super-blocks: each is weighted by its own columns' importance."""
    needs_library()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 256 * 300)).astype(F)
    weights = (rng.random(256 * 300) * 5).astype(F)
    for code in I3_TYPES.values():
        assert np.array_equal(encode_iq3(x, code, weights), quantize(x, code, weights))


def test_the_compiled_kernel_is_taken_with_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """With numba the compiled kernel encodes (the numpy path never runs); without, the numpy path (the tests
    above compare both with llama.cpp)."""
    parity.compiled_only(monkeypatch, iq3loop.kernels, iq3quants, "_encode_numpy")
    for code in I3_TYPES.values():
        encode_iq3(parity.awkward(12, 512, 2), code, parity.importance(512, 2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(list(I3_TYPES)), weighted=st.booleans())
def test_compiled_is_numpy_on_any_finite_rows(data: st.DataObject, kind: str, weighted: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llama.cpp's library too: the compiled kernel's bytes are the numpy path's on any finite values (and
    few distinct ones: ties, empty and flat blocks) and any finite importance."""
    if iq3loop.kernels() is None:
        pytest.skip("numba is not installed")
    x, w = finite_row(data, weighted)
    fast, slow = both_paths(x, I3_TYPES[kind], w, monkeypatch)
    assert np.array_equal(fast, slow)


@pytest.mark.parametrize("kind", list(I3_TYPES))
def test_each_iq3_type_decodes_as_llama_cpp_and_gguf_py_decode_it(kind: str) -> None:
    """The input side decodes IQ3_XXS and IQ3_S with torch to llama.cpp's own values and gguf-py's: on encodings
    and on random bytes."""
    needs_library()
    code = I3_TYPES[kind]
    size = ggmltypes.TYPES[code].size
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, size), dtype=np.uint8)
    noise[:, 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)  # a finite d
    for stored in (encode_iq3(parity.awkward(16, 512, 1), code), noise.reshape(16, -1)):
        ours = blocks.decode(torch.from_numpy(stored), code).numpy()
        assert np.array_equal(ours, dequantize(stored, code))
        assert np.array_equal(ours, gguf.quants.dequantize(stored, gguf.GGMLQuantizationType(code)))


# (arch, mix, importance matrix file or "", --gguf-tensor-type pairs both sides take): IQ3_XXS's attn_q and attn_k
# are IQ2_S (tests/test_gguf_iq2.py's encoder)
CASES = [("llama", "iq3_s", "", ()), ("llama", "iq3_s", "gguf", ()), ("llama", "iq3_m", "", ()),
         ("llama", "iq3_m", "dat", ()), ("llama", "iq3_xs", "gguf", ()), ("llama", "iq3_xxs", "gguf", ()),
         ("qwen3moe", "iq3_xxs", "gguf", ()), ("qwen3moe", "iq3_m", "", ())]


@pytest.mark.parametrize(("arch", "mix", "imatrix", "overrides"), CASES)
def test_each_iq3_mix_is_llama_quantize_s_on_the_same_f16_file(
        tmp_path: Path, arch: str, mix: str, imatrix: str, overrides: tuple[tuple[str, int], ...],
        merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    """Every tensor's type and bytes equal llama_model_quantize's for the IQ3 mix on the F16 file resumerge wrote
    of the same merge (the tiny models' rows are whole super-blocks: the IQ3 encoders write them), with the same
    importance matrix where one is given."""
    parity.assert_mix_is_llama_quantize_s(tmp_path, merges, arch, mix, imatrix, overrides)
    assert parity.written_types(tmp_path / "out" / "model.gguf") & {18, 21}


def test_an_importance_matrix_changes_the_iq3_xxs_mix_s_types() -> None:
    """llama.cpp's IQ3_XXS mix gives attn_v IQ3_S without a matrix and IQ3_XXS with one (Q4_K where four heads
    share a KV head), and ffn_down Q4_K (first eighth) or Q3_K without one, IQ3_XXS with one; the other IQ3 mixes'
    types do not depend on it."""
    model = ModelFacts(layers=16, gqa=2)
    plain, weighted = TypeChoices(), TypeChoices(imatrix=True)
    assert tensor_type("blk.3.attn_v.weight", (256, 512), "iq3_xxs", model, plain).llama == 21
    assert tensor_type("blk.3.attn_v.weight", (256, 512), "iq3_xxs", model, weighted).llama == 18
    assert tensor_type("blk.3.attn_v.weight", (256, 512), "iq3_xxs", ModelFacts(layers=16, gqa=4)).llama == 12
    for layer, bumped in ((0, 12), (1, 12), (2, 11), (15, 11)):
        name = f"blk.{layer}.ffn_down.weight"
        assert tensor_type(name, (256, 512), "iq3_xxs", model, plain).llama == bumped
        assert tensor_type(name, (256, 512), "iq3_xxs", model, weighted).llama == 18
    for mix in ("iq3_xs", "iq3_s", "iq3_m"):
        for name in ("blk.3.attn_v.weight", "blk.0.ffn_down.weight", "blk.5.ffn_up.weight"):
            assert tensor_type(name, (256, 512), mix, model, plain) == tensor_type(name, (256, 512), mix, model,
                                                                                 weighted)
    assert tensor_type("blk.3.attn_q.weight", (256, 576), "iq3_s", model).llama == 20  # the fallback: IQ4_NL


def test_iq3_xxs_and_iq3_xs_are_refused_without_a_matrix(
        tmp_path: Path, merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    """IQ3_XXS and IQ3_XS without an importance matrix: one line, exit 2, before any work, as llama-quantize
    refuses them; with one, IQ3_XXS's attn_q and attn_k (rows of whole super-blocks) are planned IQ2_S, as
    llama.cpp gives them."""
    config, _ = merges["llama"]
    out = tmp_path / "out"
    for mix in ("iq3_xxs", "iq3_xs"):
        done = cli_here("run", config, out, "--state-dir", tmp_path / "s", "--out-type", "gguf", "--gguf-type",
                        mix)  # refusals: the CLI's main, here
        assert done.returncode == 2 and "only with an importance matrix" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) <= 2 and "Traceback" not in done.stderr and not out.exists()
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat.\n")
    plan = api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type="iq3_xxs",
                                                                       imatrix_texts=texts)))
    kinds = {tp.out_codec.gguf_name: tp.out_codec.ggml_type for tp in plan.tensors.values()
             if hasattr(tp.out_codec, "gguf_name")}
    assert kinds["blk.0.attn_q.weight"] == kinds["blk.0.attn_k.weight"] == 22  # IQ2_S
