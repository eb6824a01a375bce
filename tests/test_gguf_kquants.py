"""GGUF's K-quants written as llama.cpp writes them (issue 84): the encoders byte-equal to ``ggml_quantize_chunk``
with and without an importance matrix, on awkward tensors and real weights; each ``--gguf-type`` mix's per-tensor
types and bytes equal to ``llama_model_quantize``'s on the F16 file resumerge writes of the same merge, with the
override flags and an imatrix (GGUF and ``.dat``); and a K-quant output killed anywhere resumes byte-identical.
llama.cpp's own library is the oracle (tests/llamacpp_oracle.py); the tests skip where it does not load."""

from __future__ import annotations

import signal
from pathlib import Path

import encoderparity as parity
import gguf
import numpy as np
import pytest
import torch
from encoderparity import merges, one_baseline, real_rows  # noqa: F401 (fixtures)
from llamacpp_oracle import needs_library, quantize, quantize_model
from support import cli, cli_here, digests, points_reached

from resumerge import api
from resumerge.errors import ModelInputError
from resumerge.inputs.gguf import blocks, ggmltypes
from resumerge.machine.killpoints import LOCAL_POINTS
from resumerge.merge.plan.gguftypes import MIXES, OVERRIDE_TYPES
from resumerge.outputs.gguf.imatrix import read_imatrix
from resumerge.outputs.gguf.kquants import encode_k
from resumerge.outputs.gguf.legacyweighted import encode_legacy_weighted

K_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
K_MIXES = [mix for mix in MIXES if "_k" in mix and not MIXES[mix].needs_imatrix]  # q2_k_s: test_gguf_iquants


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_each_k_encoder_writes_llama_cpp_s_bytes(kind: str, weighted: bool) -> None:
    needs_library()
    for seed in range(3):
        x = parity.awkward(16, 1024, seed)
        weights = parity.importance(1024, seed) if weighted else None
        ours, theirs = encode_k(x, K_TYPES[kind], weights), quantize(x, K_TYPES[kind], weights)
        assert ours.shape == theirs.shape
        assert np.array_equal(ours, theirs), (seed, np.argwhere(ours != theirs)[:5].tolist())


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_the_first_of_two_equal_magnitudes_is_the_peak(kind: str, weighted: bool) -> None:
    """The symmetric searches scale by the signed value of the *first* element of largest magnitude (llama.cpp's
    strict ``>`` scan); the encoders find it from each sub-block's max and min, so where +m and -m both occur the
    order decides: every sub-block here holds both, in either order, at random places, and in the first row the
    sub-blocks' own scales tie the same way (alternating signs)."""
    needs_library()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 512)) * 0.3).astype(np.float32)
    for r in range(8):
        for b in range(32):
            i, j = rng.choice(16, 2, replace=False)
            x[r, 16 * b + i], x[r, 16 * b + j] = (1.0 + r, -1.0 - r) if b % 2 else (-1.0 - r, 1.0 + r)
    x[0, :256] = np.tile(np.array([1, -1] * 8, np.float32), 16) * np.repeat(np.array([1, -1] * 8, np.float32), 16)
    weights = parity.importance(512, 1) if weighted else None
    assert np.array_equal(encode_k(x, K_TYPES[kind], weights), quantize(x, K_TYPES[kind], weights))


def test_q3_k_s_descent_stops_after_five_passes() -> None:
    """Q3_K's code search (make_q3_quants) moves codes for at most five passes over a sub-block: these four
    N(0, 1) sub-blocks (found by a search over 65,536) still move in the fifth, and two of them would move again in
    a sixth, which llama.cpp never takes. Each sits in a super-block of its own among ordinary ones at half its size, so
    that its scale sets the super-block's (a move changes the scale by under 1 %), at each magnitude."""
    needs_library()
    subblocks = np.random.default_rng(0).standard_normal((16, 65536)).astype(np.float32).T
    slow = subblocks[[36189, 43248, 44907, 63559]]
    rows = np.concatenate([np.concatenate([slow[i:i + 1], subblocks[15 * i:15 * i + 15] * np.float32(0.5)])
                           for i in range(4)])
    for scale in (1.0, 0.02, 300.0):
        x = (rows * np.float32(scale)).reshape(4, 256)
        assert np.array_equal(encode_k(x, K_TYPES["Q3_K"]), quantize(x, K_TYPES["Q3_K"])), scale


def extremes(seed: int) -> dict[str, np.ndarray]:
    """Rows at float32's ends: huge magnitudes whose squares and cubes overflow the searches' sums, tiny and
    subnormal ones whose scales overflow (nearest_int then sees inf, NaN or values past its range), and mixes."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((4, 512)).astype(np.float32)
    cases = {f"{mag:g}": base * np.float32(mag) for mag in (1e12, 1e18, 1e20, 1e-20, 1e-38, 1e-40, 1e-44)}
    mixed = base.copy()
    mixed[:, ::7] *= np.float32(1e18)
    mixed[:, 3::11] *= np.float32(1e-40)
    cases["mixed"] = mixed
    cases["log-uniform"] = base * np.float32(10.0) ** rng.integers(-44, 38, size=base.shape).astype(np.float32)
    subnormal = np.zeros_like(base)
    subnormal[:, ::3] = np.float32(1.4e-45) * rng.integers(-5, 6, size=subnormal[:, ::3].shape)
    cases["subnormal"] = subnormal
    cases["near max"] = np.sign(base) * np.float32(3.0e38) * (np.abs(base) > 1)
    return {name: x.astype(np.float32) for name, x in cases.items()}


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_each_k_encoder_writes_llama_cpp_s_bytes_at_float32_s_ends(kind: str, weighted: bool) -> None:
    """Magnitudes of 1e12 and up, subnormals and mixes: llama.cpp's float32 arithmetic overflows and its
    nearest_int wraps there (NaN is 0, inf is -4194304, an int8 scale wraps), and the encoders follow it."""
    needs_library()
    for seed in range(2):
        weights = parity.importance(512, seed) if weighted else None
        for name, x in extremes(seed).items():
            for scale in ((1.0,) if weights is None else (1.0, 1e30, 1e-30)):
                w = None if weights is None else weights * np.float32(scale)
                ours, theirs = encode_k(x, K_TYPES[kind], w), quantize(x, K_TYPES[kind], w)
                assert np.array_equal(ours, theirs), (seed, name, scale, np.argwhere(ours != theirs)[:3].tolist())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_the_legacy_types_importance_paths_write_llama_cpp_s_bytes(kind: str) -> None:
    """A K mix's fallbacks (rows not whole 256-value blocks) and a legacy file's tensors are weighted too when
    llama-quantize has an importance matrix (the mean square of the whole row scales every block's weights)."""
    needs_library()
    code = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7}[kind]
    x = parity.awkward(12, 576, 4)
    weights = parity.importance(576, 4)
    assert np.array_equal(encode_legacy_weighted(x, code, weights), quantize(x, code, weights))


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_each_k_encoder_writes_llama_cpp_s_bytes_on_real_weights(kind: str, real_rows: np.ndarray  # noqa: F811
                                                                  ) -> None:
    needs_library()
    for weights in (None, parity.importance(1536, 7)):
        assert np.array_equal(encode_k(real_rows, K_TYPES[kind], weights),
                              quantize(real_rows, K_TYPES[kind], weights)), weights is None


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_each_k_type_decodes_as_gguf_py_decodes_it(kind: str) -> None:
    """The input side decodes every K type with torch (one owner of the block layouts) to gguf-py's values: on
    llama.cpp's encodings and on random bytes."""
    code = K_TYPES[kind]
    size = ggmltypes.TYPES[code].size
    x = parity.awkward(16, 512, 1)
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, size), dtype=np.uint8)
    for at in {10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}[code]:  # finite f16 scales
        noise[:, at:at + 2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    for stored in (encode_k(x, code), noise.reshape(16, -1)):
        ours = blocks.decode(torch.from_numpy(stored), code).numpy()
        assert np.array_equal(ours, gguf.quants.dequantize(stored, gguf.GGMLQuantizationType(code)), equal_nan=True)


CASES = [*(("llama", mix, "") for mix in K_MIXES), ("qwen3moe", "q4_k_m", ""), ("qwen3moe", "q3_k_m", "gguf"),
         ("llama", "q2_k", "gguf"), ("llama", "q5_k_s", "dat"), ("llama", "q4_0", "gguf"),
         # issue 95: the IQ4 mixes and Q2_K_S (written only with a matrix)
         ("llama", "iq4_nl", ""), ("llama", "iq4_nl", "gguf"), ("llama", "iq4_xs", ""), ("llama", "iq4_xs", "dat"),
         ("qwen3moe", "iq4_xs", "gguf"), ("qwen3moe", "iq4_nl", ""), ("llama", "q2_k_s", "gguf")]


@pytest.mark.parametrize(("arch", "mix", "imatrix"), CASES)
def test_each_mix_is_llama_quantize_s_on_the_same_f16_file(tmp_path: Path, arch: str, mix: str, imatrix: str,
                                                           merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    """Every tensor's type and bytes equal llama_model_quantize's for the mix on the F16 file resumerge wrote of
    the same merge; with an importance matrix (llama-imatrix's GGUF, or the older .dat), llama-quantize given the
    same entries, and the bytes differ from the unweighted ones (the matrix is used)."""
    parity.assert_mix_is_llama_quantize_s(tmp_path, merges, arch, mix, imatrix)
    if imatrix and not MIXES[mix].needs_imatrix:
        quantize_model(merges[arch][1], tmp_path / "plain.gguf", MIXES[mix].file_type)
        weighted = parity.stored_tensors(tmp_path / "out" / "model.gguf")
        plain = parity.stored_tensors(tmp_path / "plain.gguf")
        assert any(weighted[n] != plain[n] for n in plain)


def test_the_override_flags_are_llama_quantize_s(tmp_path: Path, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                 ) -> None:
    """--gguf-tensor-type, --gguf-output-type and --gguf-token-embedding-type (the CLI's, through run) give the
    file llama-quantize's --tensor-type, --output-tensor-type and --token-embedding-type give."""
    needs_library()
    config, f16 = merges["llama"]
    out, state = tmp_path / "out", tmp_path / "s"
    # the CLI's main in this process (one_baseline's measurement there): what the flags give is the test's point
    done = cli_here("run", config, out, "--state-dir", state, "--out-type", "gguf", "--gguf-type", "q4_k_m",
                    "--gguf-tensor-type", "attn_q=Q8_0", "--gguf-tensor-type", "blk\\.1\\.ffn=q5_k",
                    "--gguf-output-type", "q5_k", "--gguf-token-embedding-type", "q3_k")
    assert done.returncode == 0, done.stderr
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type,
                   tensor_types=(("attn_q", OVERRIDE_TYPES["q8_0"]), ("blk\\.1\\.ffn", OVERRIDE_TYPES["q5_k"])),
                   output_type=OVERRIDE_TYPES["q5_k"], token_embedding_type=OVERRIDE_TYPES["q3_k"])
    parity.same_as_llama_quantize(out / "model.gguf", tmp_path / "llama.gguf")
    types = {n: t for n, (t, _) in parity.stored_tensors(out / "model.gguf").items()}
    assert (types["blk.0.attn_q.weight"], types["output.weight"], types["token_embd.weight"]) == (8, 13, 11)


def test_a_tensor_type_naming_the_mix_s_default_keeps_the_tensor_there(
        tmp_path: Path, merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    """llama-quantize's first matching --tensor-type wins even where it names the mix's own default type: the
    mix's bumps are then not applied (ffn_down=q4_k in a Q4_K_M file keeps the last layer's ffn_down Q4_K, where
    the mix alone gives it Q6_K); resumerge skipped such a pattern and bumped it."""
    needs_library()
    config, f16 = merges["llama"]
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", gguf_tensor_types=("ffn_down=q4_k", "blk\\.1\\.ffn_down=q8_0"))))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type,
                   tensor_types=(("ffn_down", OVERRIDE_TYPES["q4_k"]), ("blk\\.1\\.ffn_down", OVERRIDE_TYPES["q8_0"])))
    parity.same_as_llama_quantize(tmp_path / "out" / "model.gguf", tmp_path / "llama.gguf")
    types = {n: t for n, (t, _) in parity.stored_tensors(tmp_path / "out" / "model.gguf").items()}
    assert (types["blk.1.ffn_down.weight"], types["blk.1.attn_v.weight"]) == (12, 14)


def test_both_imatrix_formats_read_as_llama_quantize_applies_them(tmp_path: Path) -> None:
    entries = {"blk.0.ffn_down.weight": (np.arange(1, 9, dtype=np.float32).reshape(2, 4) * 3,
                                         np.array([3.0, 0.0], dtype=np.float32)),
               "blk.0.attn_q.weight": (np.full((1, 4), 8.0, dtype=np.float32), np.array([2.4], dtype=np.float32))}
    parity.write_imatrix_gguf(tmp_path / "m.gguf", entries)
    parity.write_imatrix_dat(tmp_path / "m.dat", entries)
    from_gguf, from_dat = read_imatrix(tmp_path / "m.gguf"), read_imatrix(tmp_path / "m.dat")
    assert from_gguf.keys() == from_dat.keys() == entries.keys()
    assert np.array_equal(from_gguf["blk.0.ffn_down.weight"], [1, 2, 3, 4, 1, 1, 1, 1])
    assert np.array_equal(from_gguf["blk.0.attn_q.weight"], [4, 4, 4, 4])  # the count rounded, as lround
    assert np.allclose(from_dat["blk.0.ffn_down.weight"], [1, 2, 3, 4, 1, 1, 1, 1])


def test_a_wrong_imatrix_is_refused_in_one_line_before_anything_is_written(
        tmp_path: Path, merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    config, f16 = merges["llama"]
    raw = parity.imatrix_entries(f16, 1)
    sums, counts = raw["blk.0.attn_q.weight"]
    cases = {"size": {**raw, "blk.0.attn_q.weight": (sums[:, :128], counts)},
             "names": {"blk.9.other.weight": (sums, counts)},
             "nan": {**raw, "blk.0.attn_q.weight": (np.full_like(sums, np.nan), counts)}}
    for case, entries in cases.items():
        path = tmp_path / f"{case}.gguf"
        parity.write_imatrix_gguf(path, entries)
        with pytest.raises(ModelInputError, match="imatrix"):
            api.plan_merge(config, settings=api.Settings(
                output=api.Output(out_type="gguf", gguf_type="q4_k_m", imatrix=str(path))))
        out = tmp_path / f"out-{case}"
        done = cli_here("run", config, out, "--state-dir", tmp_path / f"s-{case}", "--out-type", "gguf",
                        "--gguf-type", "q4_k_m", "--imatrix", path)  # refusals: the CLI's main, here
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) <= 2, (case, done.stderr)
        assert "Traceback" not in done.stderr and not (out / "model.gguf").exists(), case
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(60))
    done = cli_here("run", config, tmp_path / "o", "--out-type", "gguf", "--gguf-type", "q4_k_m", "--imatrix",
                    tmp_path / "missing.dat")
    assert done.returncode == 2 and "--imatrix" in done.stderr
    done = cli_here("run", config, tmp_path / "o", "--gguf-tensor-type", "attn_q=q8_0")
    assert done.returncode == 2 and "--out-type gguf" in done.stderr


def test_a_k_quant_output_run_killed_anywhere_resumes_byte_identical(
        tmp_path: Path, merges: dict[str, tuple[Path, Path]]) -> None:  # noqa: F811
    config, _ = merges["qwen3moe"]
    flags = ["--out-type", "gguf", "--gguf-type", "q4_k_m"]
    whole = tmp_path / "whole"  # never killed: in this process
    with points_reached() as reached:
        api.run(config, whole, settings=api.Settings(state_dir=tmp_path / "s0", output=api.Output(
            out_type="gguf", gguf_type="q4_k_m")))
    # every local point the run reaches (a one-file output without config.json or tokenizer reaches no index's or
    # tokenizer's write: a run killed there would merge to the end)
    points = [point for point in LOCAL_POINTS if point in reached]
    assert {"mid_shard_write", "after_temp_write", "after_rename", "after_ledger_commit"} <= set(points)
    for point in points:
        out, state = tmp_path / point, tmp_path / f"{point}.state"
        killed = cli("run", config, out, "--state-dir", state, *flags, env={"RESUMERGE_KILL_AT": point},
                     script=parity.ONE_BASELINE)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        api.resume(out, settings=api.Settings(state_dir=state))
        assert digests(out) == digests(whole), point
        assert api.verify(out, settings=api.Settings(state_dir=state)).ok, point
