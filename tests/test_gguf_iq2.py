"""GGUF's 2-bit i-quants written as llama.cpp writes them (issue 95): IQ2_XXS, IQ2_XS and IQ2_S byte-equal to
``ggml_quantize_chunk`` with an importance matrix (IQ2_S without one too) on awkward rows, exact ties as TIES/DARE
merges leave them, rows of zeros and zero importances; the numpy path (no numba) and the uncompiled kernels to the
compiled ones' bytes; the grids and decoders against gguf-py's; the IQ2_XXS and IQ2_XS mixes' whole files against
``llama_model_quantize`` with a matrix, and refused in one line without one. llama.cpp's own library is the oracle
(tests/llamacpp_oracle.py); those tests skip where it does not load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import encoderparity as parity
import gguf
import numpy as np
import pytest
import torch
from encoderparity import merges, one_baseline  # noqa: F401 (fixtures)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llamacpp_oracle import grids_held, needs_library, quantize, quantize_model
from support import cli, digests

from resumerge import api
from resumerge.errors import UsageError
from resumerge.inputs.gguf import blocks, ggmltypes, iq2blocks
from resumerge.merge.plan.gguftypes import MIXES, ModelFacts, TypeChoices, requires_imatrix, tensor_type
from resumerge.outputs.gguf import iq2grid, iq2loop, jit
from resumerge.outputs.gguf.iquants import encode_iq

IQ2 = {"IQ2_XXS": 16, "IQ2_XS": 17, "IQ2_S": 22}
F = np.float32


def assert_llama_cpp_s(x: np.ndarray, code: int, weights: np.ndarray | None, label: object = "") -> None:
    """``encode_iq``'s bytes, compiled (where numba is) and on the numpy path, are llama.cpp's."""
    parity.assert_encoder_is_llama_cpp_s(encode_iq, x, code, weights, label)


@pytest.mark.parametrize("kind", list(IQ2))
def test_each_iq2_encoder_writes_llama_cpp_s_bytes(kind: str) -> None:
    needs_library()
    for seed in range(3):
        weights = parity.importance(1024, seed)
        weights[:256] *= F(seed)  # seed 0: a super-block of zero importances
        assert_llama_cpp_s(parity.awkward(16, 1024, seed), IQ2[kind], weights, seed)
    if kind == "IQ2_S":  # ggml's IQ2_S has weights without a matrix too
        assert_llama_cpp_s(parity.awkward(16, 512, 5), IQ2[kind], None, "plain")


@pytest.mark.parametrize("kind", list(IQ2))
def test_exact_ties_as_merges_make_them_are_llama_cpp_s(kind: str) -> None:
    """Zeros, copies and ±m (tests/test_gguf_iquants.py's ties): the sign parity's least value is the first of
    equals, a trial scale is adopted only on a strict improvement, a group's nearest grid point the first of equal
    distances in (distance, index) order, as llama.cpp's; a tiny importance, and equal ones."""
    needs_library()
    for seed in range(3):
        weights = parity.importance(768, seed)
        weights[100:400] = weights[100]
        assert_llama_cpp_s(parity.ties(seed), IQ2[kind], weights, seed)
        assert_llama_cpp_s(parity.ties(seed), IQ2[kind], weights * F(1e-30), (seed, "tiny"))


def test_the_numpy_path_and_the_plain_kernels_are_the_compiled_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without numba the numpy path (resumerge.outputs.gguf.iq2numpy) writes the compiled kernels' bytes, and so
    do the kernels run uncompiled (iq2loop.plain, the numpy path's reference): llama.cpp's, on ties, zeros, a
    super-block of zero importances and IQ2_S without a matrix."""
    needs_library()
    x, weights = parity.numpy_path_case()
    cases = [(code, weights) for code in IQ2.values()] + [(IQ2["IQ2_S"], None)]
    compiled = [encode_iq(x, code, w) for code, w in cases]
    for (code, w), slow in zip(cases, parity.numpy_path_bytes(encode_iq, cases, x, compiled), strict=True):
        assert np.array_equal(slow, quantize(x, code, w)), code
    monkeypatch.setattr(jit, "numba_module", lambda: None)
    monkeypatch.setattr(iq2loop, "kernels", lambda: iq2loop.plain)
    for (code, w), fast in zip(cases[:3], compiled[:3], strict=True):  # slow: a super-block a second
        assert np.array_equal(encode_iq(x[:1], code, w), fast[:1]), code


# A process that builds IQ2_XXS's tables itself (the machine's kept ones turned off) and prints their digest.
_BUILT = ("import json, sys\nsys.path[:] = json.loads(sys.argv[1])\nimport numpy as np\n"
          "from llamacpp_oracle import grids_held, quantize\n"
          "quantize(np.ones((1, 256), dtype=np.float32), 16, np.ones(256, dtype=np.float32))\nprint(grids_held(0))\n")


def test_the_grids_the_oracle_keeps_are_the_ones_its_library_builds() -> None:
    """The oracle hands its library the 1- and 2-bit grids a process of this machine built and kept
    (tests/llamacpp_grids.py) instead of building them again: IQ2_XXS's tables as this process's library holds them
    after a quantization (restored from the kept copy, or built and kept here) are, byte for byte, those a process
    that builds its own builds."""
    needs_library()
    quantize(parity.awkward(16, 256, 0), IQ2["IQ2_XXS"], parity.importance(256, 0))
    here = grids_held(0)
    assert here is not None
    built = subprocess.run([sys.executable, "-c", _BUILT, json.dumps(sys.path)], capture_output=True, text=True,
                           env={**os.environ, "RESUMERGE_TEST_LLAMACPP_GRIDS": "0"}, timeout=300, check=True)
    assert built.stdout.split() == [here]


def test_one_compilation_serves_one_row_and_many() -> None:
    """The search kernel is compiled once whatever the rows' count: one super-block (what a run's memory baseline
    encodes to load the kernels) and several take the same layout of arrays (the codes were written into a view of
    the output, C-contiguous for one row and strided for more: numba compiled, and cached, the kernel twice)."""
    kernels = iq2loop.kernels()
    if kernels is None:
        pytest.skip("numba is not installed")
    for rows in (1, 3):
        encode_iq(parity.awkward(16, 256, 0)[:rows], IQ2["IQ2_S"], parity.importance(256, 0))
    assert len(kernels.search.signatures) == 1, kernels.search.signatures  # type: ignore[attr-defined]


def test_iq2_xxs_and_iq2_xs_need_an_importance_matrix() -> None:
    with pytest.raises(ValueError, match="need an importance matrix"):
        encode_iq(parity.awkward(16, 256, 0), IQ2["IQ2_XXS"], None)


@pytest.mark.parametrize("kind", list(IQ2))
def test_the_grids_and_decoders_are_gguf_py_s(kind: str) -> None:
    """The grid each type's codes index is gguf-py's (its grid_hex); every grid point is in the quantizer's map
    and every off-grid key of levels 0..2 has neighbours; random blocks decode to gguf-py's float32 bits."""
    code = IQ2[kind]
    reference = getattr(gguf.quants, kind)
    assert iq2blocks.kgrid(code).tobytes() == bytes.fromhex(reference.grid_hex.decode())
    tables = iq2grid.tables(code)
    assert np.array_equal(tables.kmap[iq2blocks.kgrid(code)], np.arange(iq2blocks.kgrid(code).size))
    keys = np.arange(tables.kmap.size)
    legal = np.all(((keys[:, None] >> (2 * np.arange(8))) & 3) < 3, axis=1)
    off = keys[legal & (tables.kmap < 0)]
    assert off.size and np.all(tables.neighbours[-tables.kmap[off] - 1] > 0)
    rng = np.random.default_rng(code)
    size = ggmltypes.TYPES[code].size
    raw = rng.integers(0, 256, (64, size), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(rng.normal(size=64).astype(np.float16).tobytes(), np.uint8).reshape(64, 2)
    want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(code)).astype(F).reshape(64, 256)
    got = blocks.decode(torch.from_numpy(raw.reshape(4, -1)), code).numpy().reshape(64, 256)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_what_the_encoder_writes_decodes_near_the_values() -> None:
    """A round trip: IQ2_S of Gaussian rows decodes within its 2.5 bits' error (a check of the layout's order)."""
    x = np.random.default_rng(3).standard_normal((16, 512)).astype(F)
    stored = encode_iq(x, IQ2["IQ2_S"], parity.importance(512, 3))
    decoded = blocks.decode(torch.from_numpy(stored), IQ2["IQ2_S"]).numpy()
    assert np.linalg.norm(decoded - x) < 0.6 * np.linalg.norm(x)


@pytest.mark.parametrize("mix", ["iq2_xxs", "iq2_xs", "iq2_s", "iq2_m"])
def test_each_iq2_mix_is_llama_quantize_s_with_a_matrix(tmp_path: Path, mix: str,
                                                        merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                        ) -> None:
    """Every tensor's type and bytes equal llama_model_quantize's for the mix, with the same importance matrix."""
    assert_mix_with_a_matrix(tmp_path, mix, merges)


def assert_mix_with_a_matrix(tmp_path: Path, mix: str, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                             ) -> None:
    """The tiny llama merge written as ``mix`` with an importance matrix: every tensor's type and bytes
    llama_model_quantize's with the same matrix, and the mix's own type among them (its encoder itself, not only
    fallbacks)."""
    parity.assert_mix_is_llama_quantize_s(tmp_path, merges, "llama", mix, "gguf")
    assert MIXES[mix].default in parity.written_types(tmp_path / "out" / "model.gguf")


@pytest.mark.parametrize("mix", ["iq2_xxs", "iq2_xs", "iq2_s", "iq2_m"])
def test_an_iq2_mix_without_a_matrix_is_refused_before_any_work(mix: str, tmp_path: Path,
                                                                merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                                ) -> None:
    config, _ = merges["llama"]
    with pytest.raises(UsageError, match="only with an importance matrix"):
        api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type=mix)))


def test_the_iq2_mixes_rules() -> None:
    """llama.cpp's 2-bit branch on one model: attn_v Q2_K (IQ3_S in IQ2_S/M files), Q4_K with 4+ heads a KV head;
    the first eighth of ffn_down Q2_K or IQ3_S; output Q5_K; token_embd Q2_K or IQ3_S; a 2-bit type needs a
    matrix, token_embd and output apart. (Every shape against llama.cpp's own choice:
    tests/test_gguf_iquants.py's test_every_mix_s_types_are_llama_cpp_s_on_every_shape.)"""
    model = ModelFacts(layers=16, gqa=2)
    with_matrix = TypeChoices(imatrix=True)
    for mix, rich in (("iq2_xxs", False), ("iq2_xs", False), ("iq2_s", True), ("iq2_m", True)):
        second = 21 if rich else 10
        assert tensor_type("blk.3.attn_v.weight", (256, 512), mix, model, with_matrix).llama == second
        assert tensor_type("blk.3.attn_v.weight", (256, 512), mix, ModelFacts(layers=16, gqa=4)).llama == 12
        assert tensor_type("blk.1.ffn_down.weight", (512, 1024), mix, model).llama == second
        assert tensor_type("blk.2.ffn_down.weight", (512, 1024), mix, model).llama == MIXES[mix].default
        assert tensor_type("output.weight", (100, 512), mix, model).llama == 13
        assert tensor_type("token_embd.weight", (100, 512), mix, model).llama == second
        assert tensor_type("blk.2.attn_q.weight", (512, 576), mix, model).llama == 20  # IQ4_NL: rows of 576
    assert requires_imatrix("blk.0.attn_q.weight", 16, "q4_k_m")
    assert not requires_imatrix("output.weight", 16, "iq2_xxs")


def test_the_override_flags_take_the_iq2_types(tmp_path: Path, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                               ) -> None:
    """--gguf-tensor-type names IQ2_XXS and IQ2_S in a Q4_K_M file as llama-quantize's --tensor-type does: with a
    matrix the file is llama_model_quantize's; without one refused at the plan in one line (llama.cpp's
    tensor_requires_imatrix), before any work."""
    needs_library()
    config, f16 = merges["llama"]
    overrides = ("ffn_down=IQ2_XXS", "attn_q=iq2_s")
    with pytest.raises(UsageError, match=r"writes blk\.0\.\w+\.weight as IQ2_\w+ only with an importance matrix"):
        api.plan_merge(config, settings=api.Settings(output=api.Output(
            out_type="gguf", gguf_type="q4_k_m", gguf_tensor_types=overrides)))
    raw = parity.imatrix_entries(f16, 4)
    parity.write_imatrix_gguf(tmp_path / "imatrix.gguf", raw)
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", gguf_tensor_types=overrides, imatrix=str(tmp_path / "imatrix.gguf"))))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type,
                   imatrix=parity.as_llama_quantize_takes_it(raw),
                   tensor_types=(("ffn_down", IQ2["IQ2_XXS"]), ("attn_q", IQ2["IQ2_S"])))
    parity.same_as_llama_quantize(tmp_path / "out" / "model.gguf", tmp_path / "llama.gguf")


def test_an_iq2_xxs_gguf_is_read_back_as_a_parent(tmp_path: Path, merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                  ) -> None:
    """An IQ2_XXS file resumerge wrote, merged again (passthrough to float32 safetensors): its IQ2_XXS matrices
    read back with torch's decoders to gguf-py's values of the stored blocks."""
    config, f16 = merges["llama"]
    parity.write_imatrix_gguf(tmp_path / "imatrix.gguf", parity.imatrix_entries(f16, 5))
    read, stored = parity.read_back(tmp_path, config, "iq2_xxs", str(tmp_path / "imatrix.gguf"))
    found = [n for n, t in stored.items() if t.tensor_type == gguf.GGMLQuantizationType.IQ2_XXS]
    assert found
    layer = found[0].split(".")[1]
    kind = found[0].split(".")[2]
    names = {"ffn_down": "mlp.down_proj", "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj",
             "attn_output": "self_attn.o_proj", "attn_v": "self_attn.v_proj"}
    if kind not in names:
        pytest.skip(f"{found[0]}: a permuted or unnamed tensor")
    want = parity.stored_values(stored[found[0]])
    assert np.array_equal(read[f"model.layers.{layer}.{names[kind]}.weight"].numpy(), want)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(data=st.data(), kind=st.sampled_from(list(IQ2)))
def test_compiled_is_numpy_on_any_moderate_rows(data: st.DataObject, kind: str) -> None:
    """Without llama.cpp's library too: the compiled kernels' bytes are the numpy path's on any values within
    ±1e6 (and few distinct ones: ties, flat and zero groups) and any importance within 0 ... 1e6. (Past that
    llama.cpp's own quantizer aborts on IQ2_XXS/IQ2_XS: its weights overflow and no grid point is nearest.)"""
    if iq2loop.kernels() is None:
        pytest.skip("numba is not installed")
    x, w = parity.moderate_row(data)
    fast, slow = parity.both_paths(encode_iq, x, IQ2[kind], w)
    assert np.array_equal(fast, slow)


def test_an_iq2_xxs_run_killed_mid_file_resumes_byte_identical(tmp_path: Path,
                                                               merges: dict[str, tuple[Path, Path]]  # noqa: F811
                                                               ) -> None:
    """Killed while the IQ2_XXS file is written (mid-write, after a unit's temp write, after the ledger commit),
    ``resume`` ends with the bytes of a run never killed, and verify passes (tests/test_gguf_iquants.py's IQ4_XS
    test, with the importance matrix the 2-bit mix needs)."""
    config, f16 = merges["llama"]
    parity.write_imatrix_gguf(tmp_path / "imatrix.gguf", parity.imatrix_entries(f16, 6))
    matrix = str(tmp_path / "imatrix.gguf")
    whole = tmp_path / "whole"
    api.run(config, whole, settings=api.Settings(state_dir=tmp_path / "s0", output=api.Output(
        out_type="gguf", gguf_type="iq2_xxs", imatrix=matrix)))
    for point in ("mid_shard_write", "after_temp_write", "after_ledger_commit"):
        out, state = tmp_path / point, tmp_path / f"{point}.state"
        killed = cli("run", config, out, "--state-dir", state, "--out-type", "gguf", "--gguf-type", "iq2_xxs",
                     "--imatrix", matrix, env={"RESUMERGE_KILL_AT": point}, script=parity.ONE_BASELINE)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        api.resume(out, settings=api.Settings(state_dir=state))
        assert digests(out) == digests(whole), point
        assert api.verify(out, api.Settings(state_dir=state)).ok, point
