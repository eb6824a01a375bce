"""What the GGUF encoder tests share (tests/test_gguf_kquants.py, _iquants, _iq1, _iq2, _iq3, _tquants and the real
models'): resumerge's encoders checked byte for byte against llama.cpp's quantizer (tests/llamacpp_oracle.py) on
both of their paths, a mix's whole file against ``llama_model_quantize``'s, and one memory baseline for their runs.

The baseline: every run measures, once per installation, a fresh process that loaded the compiled kernels of its
types (:func:`resumerge.merge.engine.footprint.run_baseline`): one import of torch and numba in a child process, 4-7
CPU s, for each set of types a run meets. These tests write a different set nearly every test (each mix with its
fallbacks, with and without a matrix: about twenty sets, 110 CPU s of a suite run) and check bytes, not memory
(tests/test_gguf_memory.py checks the kernels' baselines), so :func:`one_baseline` has their runs in this process
measure the run's modules without the kernels: the figure every other run of the suite measures (read from the
session's cache), whatever types they write.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from ggufmodels import Q, hf_tensors, to_gguf, write_gguf
from hypothesis import strategies as st
from llamacpp_oracle import needs_library, quantize, quantize_model, tensors_of
from support import write_config

from resumerge import api
from resumerge.merge.engine import footprint
from resumerge.merge.plan.gguftypes import MIXES
from resumerge.outputs.gguf import jit

__all__ = [
    "ONE_BASELINE",
    "as_llama_quantize_takes_it",
    "assert_encoder_is_llama_cpp_s",
    "assert_mix_is_llama_quantize_s",
    "awkward",
    "both_paths",
    "compiled_only",
    "imatrix_entries",
    "importance",
    "merges",
    "moderate_row",
    "numpy_path_bytes",
    "numpy_path_case",
    "one_baseline",
    "read_back",
    "real_rows",
    "same_as_llama_quantize",
    "stored_tensors",
    "stored_values",
    "ties",
    "write_imatrix_dat",
    "write_imatrix_gguf",
    "written_types",
]

F = np.float32
# ``python -m resumerge`` as one_baseline has this process's runs measure (tests/onebaseline.py): the CLI commands
# of these tests run it (``support.cli(..., script=ONE_BASELINE)``).
ONE_BASELINE = Path(__file__).with_name("onebaseline.py")
_Encode = Callable[[np.ndarray, int, np.ndarray | None], np.ndarray]


@pytest.fixture(scope="module", autouse=True)
def one_baseline() -> Iterator[None]:
    """The runs of a module that imports this fixture measure no kernel set of their own (the module docstring):
    module-scoped, so that its module-scoped fixtures' runs (the real models' releases) are covered too."""
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(footprint, "measured_spec", lambda spec: "")
        yield


@pytest.fixture(scope="module")
def real_rows(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """SmolLM2-135M's weights (its Q4_1 GGUF fixture decoded), a slice of every matrix, as rows of 1536 values: the
    stored rows that hold each matrix's first 4 x 1536 values, found by llama.cpp's GGUF parser (gguf-py's reader
    takes 4 CPU s over the vocabulary). Read once a session, whichever module asks (no test writes to it)."""
    return _real_rows(tmp_path_factory.getbasetemp())


@functools.cache
def _real_rows(_: Path) -> np.ndarray:
    from realmodel import smollm2_gguf

    taken = []
    for name, t in tensors_of(smollm2_gguf()).items():
        if t.ne[1] > 1 and "blk." in name:  # a matrix (ne: a row's length first)
            stored = np.frombuffer(t.data, dtype=np.uint8).reshape(t.ne[1], -1)[:-(-4 * 1536 // t.ne[0])]
            values = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[t.kind]).reshape(-1)
            taken.append(values[: 4 * 1536])
    return np.concatenate(taken).astype(np.float32).reshape(-1, 1536)


@pytest.fixture(scope="module")
def merges(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per family: a float16 merge's config (values exact in F16, so llama-quantize of the F16 file starts from
    them) and the F16 GGUF resumerge writes of it. Made once a session, whichever module asks first (each test
    writes its own output beside them: they are only read)."""
    return _merges(tmp_path_factory.getbasetemp() / "encoder-parity-merges")


@functools.cache
def _merges(folder: Path) -> dict[str, tuple[Path, Path]]:
    made = {}
    for arch in ("llama", "qwen3moe"):
        root = folder / arch
        root.mkdir(parents=True)
        a, b = root / "a.gguf", root / "b.gguf"
        write_gguf(a, arch, to_gguf(arch, hf_tensors(arch, seed=1)), Q.F32)
        write_gguf(b, arch, to_gguf(arch, hf_tensors(arch, seed=2)), Q.F32)
        config = write_config(root / "c.yml", {"merge_method": "linear", "dtype": "float16", "models": [
            {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
        api.run(config, root / "f16", settings=api.Settings(state_dir=root / "s", output=api.Output(out_type="gguf",
                                                                                                    gguf_type="f16")))
        made[arch] = (config, root / "f16" / "model.gguf")
    return made


def write_imatrix_gguf(path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """llama-imatrix's GGUF format (kquants.md §4): per weight ``.in_sum2`` [n_mat, n_in] and ``.counts``."""
    writer = gguf.GGUFWriter(str(path), "")
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", ["calibration.txt"])
    writer.add_uint32("imatrix.chunk_count", 4)
    writer.add_uint32("imatrix.chunk_size", 512)
    for name in sorted(entries):
        sums, counts = entries[name]
        writer.add_tensor(f"{name}.in_sum2", sums)
        writer.add_tensor(f"{name}.counts", counts.reshape(-1, 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_imatrix_dat(path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """The legacy ``.dat``: per entry ``ncall = ceil(max(counts)/chunk_size)`` and ``(sum/count)·ncall`` (count 0:
    1); then the chunk count and the dataset's name."""
    out = [struct.pack("<i", len(entries))]
    for name in sorted(entries):
        sums, counts = entries[name]
        ncall = int(np.ceil(counts.max() / 512)) or 1
        values = np.where(counts[:, None] == 0, 1.0, sums / np.where(counts == 0, 1, counts)[:, None]) * ncall
        raw = name.encode()
        out += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, values.size),
                values.astype("<f4").tobytes()]
    out += [struct.pack("<i", 4), struct.pack("<i", 15), b"calibration.txt"]
    path.write_bytes(b"".join(out))


def imatrix_entries(f16: Path, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random importance sums and counts for every quantized matrix of the GGUF ``f16`` (one count 0)."""
    rng = np.random.default_rng(seed)
    entries = {}
    for t in gguf.GGUFReader(f16).tensors:
        if len(t.shape) >= 2 and not t.name.endswith("norm.weight") and "gate_inp" not in t.name:
            n_in, n_mat = int(t.shape[0]), int(t.shape[2]) if len(t.shape) > 2 else 1
            entries[t.name] = ((rng.random((n_mat, n_in)) * 10).astype(np.float32),
                               rng.integers(1, 600, n_mat).astype(np.float32))
    first = sorted(entries)[0]
    entries[first][1][0] = 0  # a weight never reached: all ones
    return entries


def as_llama_quantize_takes_it(entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """``entries`` (sums, counts) as llama-quantize passes them to llama_model_quantize: sums over counts (count 0:
    all ones)."""
    return {name: np.where(c[:, None] == 0, 1, s / np.where(c == 0, 1, c)[:, None]).astype(np.float32).reshape(-1)
            for name, (s, c) in entries.items()}


def stored_tensors(path: Path) -> dict[str, tuple[int, bytes]]:
    """Each tensor of the GGUF at ``path``: (its ggml type, its bytes), by name (gguf-py's reader)."""
    return {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(path).tensors}


def same_as_llama_quantize(ours: Path, theirs: Path) -> None:
    """The GGUFs ``ours`` and ``theirs`` hold the same tensors, each of the same type and bytes."""
    got, want = stored_tensors(ours), stored_tensors(theirs)
    assert got.keys() == want.keys()
    types = {n: (gguf.GGMLQuantizationType(got[n][0]).name, gguf.GGMLQuantizationType(want[n][0]).name)
             for n in got if got[n][0] != want[n][0]}
    assert not types, types
    assert [n for n in got if got[n][1] != want[n][1]] == []



def awkward(rows: int, columns: int, seed: int) -> np.ndarray:
    """Rows that exercise every branch of the searches: normal, bf16-exact, all zero, constant, a sub-block of
    zeros, one huge outlier, all positive, all negative, tiny values, a ramp, few distinct values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    x[1] = torch.from_numpy(x[1] * 0.02).bfloat16().float().numpy()
    x[2] = 0
    x[3] = 0.375
    x[4, 16:48] = 0
    x[5, 7] = 300.0
    x[6] = np.abs(x[6]) + 0.1
    x[7] = -np.abs(x[7])
    x[8] *= 1e-6
    x[9] = np.linspace(-1, 1, columns, dtype=np.float32)
    x[10] = rng.integers(-2, 3, columns).astype(np.float32)
    return x


def importance(columns: int, seed: int) -> np.ndarray:
    """An importance matrix's row of ``columns``: skewed positive values, the first 40 zero (never seen by the
    calibration text)."""
    rng = np.random.default_rng(seed)
    weights = (rng.random(columns) ** 3 * 20).astype(np.float32)
    weights[:40] = 0  # columns never seen by the calibration text
    return weights


def ties(seed: int) -> np.ndarray:
    """Rows as TIES and DARE merges leave them: most values exactly 0, the rest copies of few magnitudes of both
    signs (bf16-exact), whole blocks of zeros, a block of one value repeated, the largest magnitude reached by +m
    and -m in either order, and blocks whose only nonzero value is tiny."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((12, 768)).astype(F) * F(0.02)).bfloat16().float().numpy()
    for r, density in enumerate((0.1, 0.3, 0.5, 0.9)):
        x[r] *= rng.random(768) < density
    x[4] = np.where(rng.random(768) < 0.4, rng.choice(np.array([-0.03, -0.01, 0.01, 0.03], dtype=F), 768), F(0))
    x[5, :256] = 0
    x[5, 300:332] = F(0.015)
    x[6] = 0
    for b in range(24):  # +m and -m both in every block, at random places
        i, j = rng.choice(32, 2, replace=False)
        x[7, 32 * b + i], x[7, 32 * b + j] = (F(0.05), F(-0.05)) if b % 2 else (F(-0.05), F(0.05))
    x[8] = 0
    x[8, ::32] = F(1e-16)  # under 1e-15: a zero scale
    x[9] = np.repeat(x[9, ::32], 32)
    x[10] = np.tile(x[10, :32], 24)
    x[11] = np.sign(x[11]) * F(0.02)
    return x


def moderate_row(data: st.DataObject, n: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """A drawn row (1, ``n``) of values within ±1e6 (or of few distinct ones: ties, flat and zero blocks) and an
    importance (``n``,) within 0 ... 1e6 (float32)."""
    moderate = st.floats(-1e6, 1e6, width=32, allow_subnormal=True)
    values = data.draw(st.one_of(
        st.lists(moderate, min_size=n, max_size=n),
        st.lists(st.sampled_from([0.0, -0.0, 0.25, -0.5, 1.0, 3.0, 1e-30, -7.0]), min_size=n, max_size=n)))
    weights = data.draw(st.lists(st.floats(0, 1e6, width=32), min_size=n, max_size=n))
    return np.array(values, dtype=F).reshape(1, n), np.array(weights, dtype=F)


def numpy_path_case() -> tuple[np.ndarray, np.ndarray]:
    """Rows and importances on which the numpy path and a kernel run uncompiled must write the compiled kernel's
    bytes: ties (zeros, copies, ±m) and an awkward row, over two super-blocks, the second with zero importances."""
    x = ties(4)[:4, :512].copy()
    x[3] = awkward(16, 512, 9)[3]
    weights = importance(512, 9)
    weights[256:] = 0
    return x, weights


def compiled_only(monkeypatch: pytest.MonkeyPatch, kernels: Callable[[], object], module: ModuleType,
                  *steps: str) -> None:
    """Skip the test without numba (``kernels()`` None); else each of ``module``'s numpy-path ``steps`` fails the
    test where it runs (the compiled kernels are the path taken)."""
    if kernels() is None:
        pytest.skip("numba is not installed")

    def refused(*_: object, **__: object) -> None:
        raise AssertionError("the numpy path ran")

    for name in steps:
        monkeypatch.setattr(module, name, refused)


def numpy_path_bytes(encode: _Encode, cases: list[tuple[int, np.ndarray | None]], x: np.ndarray,
                     compiled: list[np.ndarray]) -> list[np.ndarray]:
    """``encode``'s bytes of ``x`` for each (code, weights) of ``cases`` without numba, each checked equal to the
    compiled kernel's (``compiled``, in the same order)."""
    found = []
    with pytest.MonkeyPatch.context() as patched, np.errstate(all="ignore"):
        patched.setattr(jit, "numba_module", lambda: None)
        for (code, w), fast in zip(cases, compiled, strict=True):
            found.append(encode(x, code, w))
            assert np.array_equal(found[-1], fast), code
    return found


def both_paths(encode: _Encode, x: np.ndarray, code: int, weights: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """``encode``'s bytes of ``x`` as ``code`` (with ``weights``), compiled (where numba is) and without numba (the
    numpy path)."""
    with np.errstate(all="ignore"):
        fast = encode(x, code, weights)
    with pytest.MonkeyPatch.context() as patched, np.errstate(all="ignore"):
        patched.setattr(jit, "numba_module", lambda: None)
        slow = encode(x, code, weights)
    return fast, slow


def assert_encoder_is_llama_cpp_s(encode: _Encode, x: np.ndarray, code: int, weights: np.ndarray | None,
                                  label: object = "") -> None:
    """``encode``'s bytes, compiled (where numba is) and on the numpy path, are llama.cpp's."""
    theirs = quantize(x, code, weights)
    for path, ours in zip(("compiled", "numpy"), both_paths(encode, x, code, weights), strict=True):
        assert ours.shape == theirs.shape
        assert np.array_equal(ours, theirs), (label, path, np.argwhere(ours != theirs)[:5].tolist())


def assert_mix_is_llama_quantize_s(tmp_path: Path, merges: dict[str, tuple[Path, Path]], arch: str, mix: str,
                                   imatrix: str = "", overrides: tuple[tuple[str, int], ...] = ()) -> None:
    """The tiny ``arch`` merge written as ``mix`` (with an importance matrix in the format ``imatrix``, ``gguf`` or
    ``dat``, where given; ``--gguf-tensor-type`` pairs both sides take): every tensor's type and bytes
    llama_model_quantize's on the F16 file resumerge wrote of the same merge, with the same matrix."""
    needs_library()
    config, f16 = merges[arch]
    names = {18: "iq3_xxs", 21: "iq3_s"}
    output = api.Output(out_type="gguf", gguf_type=mix,
                        gguf_tensor_types=tuple(f"{p}={names[t]}" for p, t in overrides))
    entries = None
    if imatrix:
        raw = imatrix_entries(f16, 3)
        path = tmp_path / f"imatrix.{imatrix}"
        (write_imatrix_gguf if imatrix == "gguf" else write_imatrix_dat)(path, raw)
        entries = as_llama_quantize_takes_it(raw)
        output = api.Output(out_type="gguf", gguf_type=mix, gguf_tensor_types=output.gguf_tensor_types,
                            imatrix=str(path))
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=output))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES[mix].file_type, imatrix=entries, tensor_types=overrides)
    same_as_llama_quantize(tmp_path / "out" / "model.gguf", tmp_path / "llama.gguf")


def read_back(tmp_path: Path, config: Path, mix: str, imatrix: str | None = None
              ) -> tuple[dict[str, torch.Tensor], dict[str, gguf.ReaderTensor]]:
    """The ``mix`` GGUF of ``config`` (with the importance matrix at ``imatrix``) merged again (passthrough to
    float32 safetensors): its tensors, and the GGUF's stored tensors (gguf-py's) by name."""
    from safetensors.torch import load_file

    api.run(config, tmp_path / "q", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type=mix, imatrix=imatrix)))
    again = write_config(tmp_path / "again.yml", {"merge_method": "passthrough", "dtype": "float32",
                                                  "models": [{"model": str(tmp_path / "q" / "model.gguf")}]})
    # the tensors, not the tokenizer (its rebuild from the GGUF: an import of transformers in a child process)
    api.run(again, tmp_path / "f32", settings=api.Settings(state_dir=tmp_path / "s2",
                                                          output=api.Output(copy_tokenizer=False)))
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "q" / "model.gguf").tensors}
    return load_file(tmp_path / "f32" / "model.safetensors"), stored


def stored_values(tensor: gguf.ReaderTensor) -> np.ndarray:
    """gguf-py's values of a stored GGUF tensor (a ``GGUFReader`` tensor)."""
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # type: ignore[no-any-return]


def written_types(path: Path) -> set[int]:
    """The ggml types of the GGUF at ``path``'s tensors."""
    return {kind for kind, _ in stored_tensors(path).values()}
