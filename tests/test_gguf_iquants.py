"""GGUF's 4-bit i-quants written as llama.cpp writes them (issue 95): IQ4_NL and IQ4_XS byte-equal to
``ggml_quantize_chunk`` with and without an importance matrix, on awkward rows, exact ties (the zeros TIES/DARE
merges leave), float32's ends and real weights, the compiled kernels to the numpy path's bits; every mix's
per-tensor types equal to llama.cpp's own choice on model shapes no tiny model has (the IQ4_NL, IQ4_XS and Q2_K_S
mixes' whole files against ``llama_model_quantize``: tests/test_gguf_kquants.py's CASES; an importance matrix
changing the IQ4 mixes' types, not only their bytes); Q2_K_S and the i-quants resumerge does not write yet refused
in one line; ``resumerge run --gguf-type iq4_xs`` loaded and run by llama.cpp, read back as a parent, and resumed
after a kill. llama.cpp's own library is the oracle (tests/llamacpp_oracle.py); those tests skip where it does not
load."""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

import encoderparity as parity
import gguf
import numpy as np
import pytest
import torch
from encoderparity import merges, one_baseline, real_rows  # noqa: F401 (fixtures)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llamacpp_oracle import (
    imatrix_of_forward,
    needs_library,
    quant_types,
    quantize,
    quantize_model,
    tensors_of,
)
from support import cli, cli_here, digests
from test_gguf_kquants import extremes

from resumerge import api
from resumerge.errors import ModelInputError
from resumerge.inputs.gguf import blocks, ggmltypes
from resumerge.merge.plan.gguftypes import MIXES, ModelFacts, TypeChoices, tensor_type
from resumerge.outputs.gguf import iqloop, iquants, jit
from resumerge.outputs.gguf.iquants import encode_iq

I_TYPES = {"IQ4_NL": 20, "IQ4_XS": 23}
F = np.float32


@pytest.fixture
def no_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba as if not installed: the encoders take their numpy path."""
    monkeypatch.setattr(jit, "numba_module", lambda: None)


def both_paths(x: np.ndarray, code: int, weights: np.ndarray | None,
               monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    """``encode_iq``'s bytes as taken here (compiled where numba is) and without numba (the numpy path)."""
    return parity.both_paths(encode_iq, x, code, weights)


def assert_llama_cpp_s(x: np.ndarray, code: int, weights: np.ndarray | None, monkeypatch: pytest.MonkeyPatch,
                       label: object = "") -> None:
    parity.assert_encoder_is_llama_cpp_s(encode_iq, x, code, weights, label)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(I_TYPES))
def test_each_iq4_encoder_writes_llama_cpp_s_bytes(kind: str, weighted: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    needs_library()
    for seed in range(3):
        x = parity.awkward(16, 1024, seed)
        assert_llama_cpp_s(x, I_TYPES[kind], parity.importance(1024, seed) if weighted else None, monkeypatch, seed)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(I_TYPES))
def test_exact_ties_as_merges_make_them_are_llama_cpp_s(kind: str, weighted: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Many values exactly equal (zeros, copies, ±m): the nearest level's ties go to the upper level, a candidate
    scale is adopted only on a strict improvement, the peak is the first of equal magnitudes, as llama.cpp's."""
    needs_library()
    for seed in range(3):
        weights = parity.importance(768, seed) if weighted else None
        if weights is not None:
            weights[100:400] = weights[100]  # equal weights too
        assert_llama_cpp_s(parity.ties(seed), I_TYPES[kind], weights, monkeypatch, seed)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(I_TYPES))
def test_each_iq4_encoder_writes_llama_cpp_s_bytes_at_float32_s_ends(kind: str, weighted: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Magnitudes whose squares overflow (the weights and sums inf or NaN, the codes of a NaN scale the top
    level), subnormals whose inverse scales overflow, and mixes: the bytes still llama.cpp's."""
    needs_library()
    for seed in range(2):
        weights = parity.importance(512, seed) if weighted else None
        for name, x in extremes(seed).items():
            for scale in ((1.0,) if weights is None else (1.0, 1e30, 1e-30)):
                w = None if weights is None else weights * F(scale)
                assert_llama_cpp_s(x, I_TYPES[kind], w, monkeypatch, (seed, name, scale))


@pytest.mark.parametrize("kind", list(I_TYPES))
def test_each_iq4_encoder_writes_llama_cpp_s_bytes_on_real_weights(kind: str, real_rows: np.ndarray,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    needs_library()
    for weights in (None, parity.importance(1536, 7)):
        assert_llama_cpp_s(real_rows, I_TYPES[kind], weights, monkeypatch, weights is None)


def test_the_nearest_level_is_best_index_int8_s_on_every_kind_of_value() -> None:
    """The numpy path's level index (a table on ``floor``) against C's bisection written out: at and between the
    levels, one ulp either side of each midpoint, past the ends, ±0, ±inf and NaN."""
    levels = [float(v) for v in blocks.IQ4_VALUES]

    def bisect(v: float) -> int:
        if v <= levels[0]:
            return 0
        if v >= levels[-1]:
            return 15
        lo, hi = 0, 15
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if v < levels[mid]:
                hi = mid
            else:
                lo = mid
        return hi - 1 if F(v) - F(levels[hi - 1]) < F(levels[hi]) - F(v) else hi

    mids = [F((a + b) / 2) for a, b in itertools.pairwise(levels)]
    probes = [*levels, *mids, *(np.nextafter(m, F(-200)) for m in mids), *(np.nextafter(m, F(200)) for m in mids),
              -200.0, 200.0, 0.0, -0.0, np.inf, -np.inf, np.nan, -126.99, 112.99, 1e-30, -1e-30]
    v = np.array(probes, dtype=F)
    v = np.concatenate([v, np.random.default_rng(0).uniform(-130, 116, 4096).astype(F)])
    assert iquants.best_index(v).tolist() == [bisect(float(e)) for e in v]


@pytest.mark.parametrize("kind", list(I_TYPES))
def test_each_iq4_type_decodes_as_gguf_py_decodes_it(kind: str) -> None:
    """The input side decodes IQ4_NL and IQ4_XS with torch to gguf-py's values: on encodings and random bytes."""
    code = I_TYPES[kind]
    size = ggmltypes.TYPES[code].size
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, size), dtype=np.uint8)
    noise[:, 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)  # a finite d
    for stored in (encode_iq(parity.awkward(16, 512, 1), code), noise.reshape(16, -1)):
        ours = blocks.decode(torch.from_numpy(stored), code).numpy()
        assert np.array_equal(ours, gguf.quants.dequantize(stored, gguf.GGMLQuantizationType(code)))


def test_an_iq4_xs_gguf_is_read_back_as_a_parent(tmp_path: Path, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                 ) -> None:
    """An IQ4_XS file resumerge wrote, merged again (passthrough to float32 safetensors): its matrices read back
    with torch's decoders to gguf-py's values of the stored blocks."""
    read, stored = parity.read_back(tmp_path, merges["llama"][0], "iq4_xs")
    down = stored["blk.1.ffn_down.weight"]
    assert down.tensor_type == gguf.GGMLQuantizationType.IQ4_XS
    assert np.array_equal(read["model.layers.1.mlp.down_proj.weight"].numpy(), parity.stored_values(down))


def test_the_compiled_kernels_are_taken_with_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """With numba the search and the codes are the compiled kernels' (the numpy path never runs); without, the
    numpy path's (test_each_iq4_encoder... compare both with llama.cpp)."""
    parity.compiled_only(monkeypatch, iqloop.kernels, iquants, "search_numpy", "best_index")
    x = parity.awkward(12, 512, 2)
    for code in I_TYPES.values():
        encode_iq(x, code, parity.importance(512, 2))
        encode_iq(x, code)


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(list(I_TYPES)), weighted=st.booleans())
def test_compiled_is_numpy_on_any_finite_rows(data: st.DataObject, kind: str, weighted: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llama.cpp's library too: the compiled kernels' bytes are the numpy path's on any finite values (and
    few distinct ones: ties, flat and zero blocks) and any finite importance."""
    if iqloop.kernels() is None:
        pytest.skip("numba is not installed")
    x, w = finite_row(data, weighted)
    fast, slow = both_paths(x, I_TYPES[kind], w, monkeypatch)
    assert np.array_equal(fast, slow)


def finite_row(data: st.DataObject, weighted: bool, n: int = 256) -> tuple[np.ndarray, np.ndarray | None]:
    """A row of ``n`` finite float32 values, or of few distinct ones (ties, flat and zero blocks, float32's ends),
    and where ``weighted`` any finite importance: what an i-quant's compiled kernel and numpy path must agree on."""
    values = data.draw(st.one_of(
        st.lists(finite32, min_size=n, max_size=n),
        st.lists(st.sampled_from([0.0, -0.0, 0.25, -0.5, 1.0, 3.0, 1e-45, -3e38]), min_size=n, max_size=n)))
    w = np.array(data.draw(st.lists(st.floats(0, float(F(3e38)), width=32, allow_subnormal=True), min_size=n,
                                    max_size=n)), dtype=F) if weighted else None
    return np.array(values, dtype=F).reshape(1, n), w


def test_a_row_split_across_chunks_keeps_each_block_s_importance() -> None:
    """Rows longer than a chunk of blocks: each super-block is weighted by its own columns' importance."""
    needs_library()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 256 * 300)).astype(F)
    weights = (rng.random(256 * 300) * 5).astype(F)
    for code in I_TYPES.values():
        assert np.array_equal(encode_iq(x, code, weights), quantize(x, code, weights))


IQ4_MIXES = ["iq4_nl", "iq4_xs"]


def test_the_override_flags_take_the_iq4_types(tmp_path: Path, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                               ) -> None:
    """--gguf-tensor-type and --gguf-output-type name IQ4_NL and IQ4_XS as llama-quantize's flags do."""
    needs_library()
    config, f16 = merges["llama"]
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", gguf_tensor_types=("ffn_down=IQ4_XS", "attn_q=iq4_nl"),
        gguf_output_type="iq4_xs")))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type,
                   tensor_types=(("ffn_down", I_TYPES["IQ4_XS"]), ("attn_q", I_TYPES["IQ4_NL"])),
                   output_type=I_TYPES["IQ4_XS"])
    parity.same_as_llama_quantize(tmp_path / "out" / "model.gguf", tmp_path / "llama.gguf")
    types = {n: t for n, (t, _) in parity.stored_tensors(tmp_path / "out" / "model.gguf").items()}
    assert (types["blk.0.ffn_down.weight"], types["blk.1.attn_q.weight"], types["output.weight"]) == (23, 20, 23)


# name -> (arch, n_embd, n_ff, n_layer, n_head, n_head_kv, n_expert, head dim), tied: the shapes the rules read
SHAPES = {"llama-8b": (("llama", 4096, 14336, 32, 32, 8, 0, 128), False),  # 4 heads a KV head
          "llama-70b": (("llama", 8192, 28672, 80, 64, 8, 0, 128), False),  # the 70B bump
          "smollm2": (("llama", 576, 1536, 30, 9, 3, 0, 64), True),  # rows of 576: the fallbacks; tied
          "mha": (("llama", 512, 288, 16, 8, 8, 0, 64), False),  # a KV head each; ffn_down rows of 288
          "mixtral": (("llama", 1024, 512, 8, 16, 4, 8, 64), False)}  # 8 experts


def _tensors_of_shape(hparams: tuple[int, ...], tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """A model's quantized tensors (name, ggml ne) in llama.cpp's order."""
    _, embd, ff, layers, heads, kv, experts, head = hparams
    found: list[tuple[str, tuple[int, ...]]] = [] if tied else [("output.weight", (embd, 1000))]
    found.append(("token_embd.weight", (embd, 1000)))
    ffn = ("_exps", (experts,)) if experts else ("", ())
    for i in range(layers):
        found += [(f"blk.{i}.attn_k.weight", (embd, kv * head)), (f"blk.{i}.attn_output.weight", (heads * head, embd)),
                  (f"blk.{i}.attn_q.weight", (embd, heads * head)), (f"blk.{i}.attn_v.weight", (embd, kv * head)),
                  (f"blk.{i}.ffn_down{ffn[0]}.weight", (ff, embd, *ffn[1])),
                  (f"blk.{i}.ffn_gate{ffn[0]}.weight", (embd, ff, *ffn[1])),
                  (f"blk.{i}.ffn_up{ffn[0]}.weight", (embd, ff, *ffn[1]))]
    return found


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_mix_s_types_are_llama_cpp_s_on_every_shape(shape: str) -> None:
    """Each quantized --gguf-type's type for every tensor of model shapes the tiny tests cannot reach (4+ heads a
    KV head, 16-80 layers, a 70B, 8 experts, rows of 576 and 288, tied embeddings) equals llama.cpp's own choice
    (``llama_quant_compute_types``, no model file, no importance matrix)."""
    needs_library()
    hparams, tied = SHAPES[shape]
    tensors = _tensors_of_shape(hparams, tied)
    _, _, _, layers, heads, kv, experts, _ = hparams
    model = ModelFacts(tied=tied, experts=experts, layers=layers, gqa=heads // kv,
                       is_70b=layers == 80 and heads != kv)
    for mix, kind in MIXES.items():
        if not ggmltypes.TYPES[kind.default].is_block:
            continue
        theirs = quant_types(hparams[0], hparams[1:], tensors, kind.file_type)
        ours = [tensor_type(name, tuple(reversed(ne)), mix, model).llama for name, ne in tensors]
        differ = [(name, o, t) for (name, _), o, t in zip(tensors, ours, theirs, strict=True) if o != t]
        assert not differ, (mix, differ[:6])


@pytest.mark.parametrize("mix", IQ4_MIXES)
def test_an_importance_matrix_changes_the_iq4_mixes_types(mix: str) -> None:
    """llama.cpp's IQ4 mixes give the first eighth of ffn_down Q5_K without an importance matrix and keep the
    i-quant with one; attn_v is Q5_K where four or more heads share a KV head; a row not whole 256-value blocks
    takes IQ4_NL in an IQ4_XS file, and output.weight Q8_0 where its rows are not whole blocks of the mix's
    type, else Q6_K. (The bytes and the types of the mixes on models: the tests above and
    tests/test_gguf_iquants_real.py.)"""
    model = ModelFacts(layers=16, gqa=4)
    default = MIXES[mix].default
    for layer, bumped in ((0, True), (1, True), (2, False), (15, False)):
        name = f"blk.{layer}.ffn_down.weight"
        assert tensor_type(name, (256, 512), mix, model).llama == (13 if bumped else default)
        assert tensor_type(name, (256, 512), mix, model, TypeChoices(imatrix=True)).llama == default
    assert tensor_type("blk.3.attn_v.weight", (64, 256), mix, model).llama == 13
    assert tensor_type("blk.3.attn_v.weight", (64, 256), mix, ModelFacts(layers=16, gqa=2)).llama == default
    assert tensor_type("blk.3.attn_q.weight", (576, 576), mix, model).llama == 20
    assert tensor_type("output.weight", (100, 576), mix, model).llama == 8  # Q6_K's fallback, or not whole blocks
    assert tensor_type("output.weight", (100, 512), mix, model).llama == 14
    assert tensor_type("blk.3.attn_q.weight", (64, 40), mix, model).written == 1  # F16: llama.cpp refuses it


def test_q2_k_s_and_the_other_i_quants_are_refused_in_one_line(tmp_path: Path,
                                                                 merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                                 ) -> None:
    """Q2_K_S without an importance matrix is refused before any work, as llama-quantize refuses it; with an
    --imatrix lacking a tensor's entry, refused at the plan; a type llama-quantize does not have is refused in one
    line, never taken for another."""
    config, f16 = merges["llama"]
    out = tmp_path / "out"
    done = cli_here("run", config, out, "--state-dir", tmp_path / "s", "--out-type", "gguf", "--gguf-type",
                    "q2_k_s")  # refusals: the CLI's main, here
    assert done.returncode == 2 and "only with an importance matrix" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2 and "Traceback" not in done.stderr and not out.exists()
    raw = parity.imatrix_entries(f16, 2)
    del raw["blk.1.ffn_up.weight"]
    parity.write_imatrix_gguf(tmp_path / "partial.gguf", raw)
    with pytest.raises(ModelInputError, match=r"blk\.1\.ffn_up\.weight as Q2_K only with an importance matrix"):
        api.plan_merge(config, settings=api.Settings(output=api.Output(
            out_type="gguf", gguf_type="q2_k_s", imatrix=str(tmp_path / "partial.gguf"))))
    texts = tmp_path / "texts.txt"  # a matrix computed on the merge will have every block tensor's entry
    texts.write_text("the cat sat on the mat.\n")
    api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type="q2_k_s",
                                                                imatrix_texts=texts)))
    done = cli_here("run", config, out, "--out-type", "gguf", "--gguf-type", "iq1_xs")  # no llama-quantize type
    assert done.returncode == 2 and "iq1_xs" in done.stderr and not out.exists()
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_iq4_xs_run_is_loaded_and_run_by_llama_cpp(tmp_path: Path,
                                                       merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                       ) -> None:
    """``resumerge run --out-type gguf --gguf-type iq4_xs`` end to end (the CLI): llama.cpp's library loads the
    file and decodes a text with it, and every tensor is llama-quantize's (its IQ4_XS and fallback tensors)."""
    needs_library()
    config, f16 = merges["llama"]
    out = tmp_path / "out"
    # the CLI's main in this process (one_baseline's measurement there, as ONE_BASELINE's in a process of its own)
    done = cli_here("run", config, out, "--state-dir", tmp_path / "s", "--out-type", "gguf", "--gguf-type", "iq4_xs")
    assert done.returncode == 0, done.stderr
    model = out / "model.gguf"
    assert {t.kind for t in tensors_of(model).values()} >= {"IQ4_XS", "Q6_K"}
    seen = imatrix_of_forward(model, [list(range(1, 33))])
    assert seen and all(np.isfinite(sums).all() for sums, _ in seen.values())
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["iq4_xs"].file_type)
    parity.same_as_llama_quantize(model, tmp_path / "llama.gguf")


def test_an_iq4_xs_run_killed_mid_file_resumes_byte_identical(tmp_path: Path,
                                                               merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                               ) -> None:
    """Killed while the IQ4_XS file is written (mid-write, after a unit's temp write, after the ledger commit),
    ``resume`` ends with the bytes of a run never killed, and verify passes (as the K mixes' test does at every
    point, tests/test_gguf_kquants.py)."""
    config, _ = merges["qwen3moe"]
    whole = tmp_path / "whole"
    api.run(config, whole, settings=api.Settings(state_dir=tmp_path / "s0", output=api.Output(
        out_type="gguf", gguf_type="iq4_xs")))
    for point in ("mid_shard_write", "after_temp_write", "after_ledger_commit"):
        out, state = tmp_path / point, tmp_path / f"{point}.state"
        killed = cli("run", config, out, "--state-dir", state, "--out-type", "gguf", "--gguf-type", "iq4_xs",
                     env={"RESUMERGE_KILL_AT": point}, script=parity.ONE_BASELINE)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        api.resume(out, settings=api.Settings(state_dir=state))
        assert digests(out) == digests(whole), point
        assert api.verify(out, api.Settings(state_dir=state)).ok, point
