"""The K-quant encoders' compiled layouts (resumerge/outputs/gguf/klayout.py) write the numpy path's bytes: each
kernel against the numpy code it replaces, bit for bit, and whole encodings with and without them, on awkward
rows, float32's ends (where the recode kernel hands the chunk back to numpy) and chunks whose importance rows
start mid-row. The numpy path is llama.cpp's bytes (tests/test_gguf_kquants.py, which runs the compiled path)."""

from __future__ import annotations

import encoderparity as parity
import numpy as np
import pytest
from test_gguf_kquants import K_TYPES, extremes

from resumerge.inputs.gguf import ggmltypes
from resumerge.outputs.gguf import klayout, kquants

pytestmark = pytest.mark.skipif(klayout.kernels() is None, reason="numba is not installed")

MODES = {"plain": klayout.PLAIN, "importance": klayout.IMPORTANCE, "qw": klayout.QW, "rms": klayout.RMS,
         "abs": klayout.ABS}


def numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(klayout, "kernels", lambda: None)


def both(monkeypatch: pytest.MonkeyPatch, call: object) -> tuple[object, object]:
    """``call()`` compiled, then on the numpy path (overflows as :func:`.kquants.encode_k` allows them)."""
    with np.errstate(all="ignore"):
        compiled = call()  # type: ignore[operator]
        with monkeypatch.context() as patch:
            numpy_only(patch)
            reference = call()  # type: ignore[operator]
    return compiled, reference


@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_layout_kernel_writes_the_numpy_layout_and_weights(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                               n: int) -> None:
    block = parity.awkward(37, 256, 0)  # 37 super-blocks: two tiles and a part
    block[11] *= np.float32(1e20)  # squares that overflow: inf sums and weights, as numpy's
    block[12] *= np.float32(1e-40)
    qw = parity.importance(5 * 256, 1).reshape(5, 256)
    for offset in (0, 3):
        for factor in (1.0, 2.0):
            compiled, reference = both(monkeypatch, lambda o=offset, f=factor: kquants._layout(
                block, qw, o, n, MODES[mode], f))
            for ours, theirs in zip(compiled, reference, strict=True):  # type: ignore[call-overload]
                assert (ours is None) == (theirs is None)
                if ours is not None:
                    assert ours.dtype == theirs.dtype
                    assert ours.tobytes() == theirs.tobytes(), (mode, offset, factor)


@pytest.mark.parametrize(("low", "high", "offsets"), [(0, 15, True), (-32, 31, False), (-4, 3, False)])
def test_the_recode_kernel_writes_the_numpy_codes(monkeypatch: pytest.MonkeyPatch, low: int, high: int,
                                                  offsets: bool) -> None:
    rng = np.random.default_rng(2)
    n = 32 if offsets else 16
    x = kquants._subblocks(np.ascontiguousarray(parity.awkward(21, 256, 3).T), n)
    d = (np.abs(x).max(axis=0) / np.float32(high - low) * np.float32(0.97)).astype(np.float32)
    d[::5] = 0  # the search's codes kept
    d[1::7] = -d[1::7]
    m = (-x.min(axis=0)).astype(np.float32) if offsets else None
    searched = rng.integers(0, high - low + 1, x.shape).astype(np.float32)

    def codes_at(cols: np.ndarray) -> np.ndarray:
        return searched[:, cols]

    compiled, reference = both(monkeypatch, lambda: kquants._codes(
        x, searched if offsets else codes_at, d, m, low, high))
    assert compiled.dtype == np.uint8  # type: ignore[union-attr]
    assert compiled.tobytes() == reference.tobytes()  # type: ignore[union-attr]


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_each_k_encoder_writes_the_same_bytes_compiled_and_in_numpy(monkeypatch: pytest.MonkeyPatch, kind: str,
                                                                    weighted: bool) -> None:
    """Awkward rows, float32's ends, and 2100 super-blocks of rows of 3 (chunks whose first super-block is not a
    row's first, so their importance rows start mid-row; the last chunk a part)."""
    rng = np.random.default_rng(4)
    cases = {"awkward": parity.awkward(24, 1024, 5), **extremes(6),
             "many": (rng.standard_normal((700, 768)) * 0.02).astype(np.float32)}
    for name, x in cases.items():
        weights = parity.importance(x.shape[1], 7) if weighted else None
        compiled, reference = both(monkeypatch, lambda v=x, w=weights: kquants.encode_k(v, K_TYPES[kind], w))
        assert compiled.tobytes() == reference.tobytes(), name  # type: ignore[union-attr]


@pytest.mark.parametrize(("kind", "n", "levels"), [("Q2_K", 16, 4), ("Q3_K", 16, 8), ("Q4_K", 32, 16),
                                                   ("Q5_K", 32, 32), ("Q6_K", 16, 64)])
def test_the_pack_kernel_writes_the_numpy_quants(monkeypatch: pytest.MonkeyPatch, kind: str, n: int,
                                                 levels: int) -> None:
    """Every code of the type's range, 70 super-blocks (a tile of 64 and a part), the heads' bytes untouched."""
    codes = np.random.default_rng(8).integers(0, levels, (n, 256 // n * 70)).astype(np.uint8)
    size = ggmltypes.TYPES[K_TYPES[kind]].size

    def packed() -> np.ndarray:
        out = np.full((70, size), 0xA5, dtype=np.uint8)
        kquants._pack(codes, K_TYPES[kind], out)
        return out

    compiled, reference = both(monkeypatch, packed)
    assert compiled.tobytes() == reference.tobytes()  # type: ignore[union-attr]


def test_the_kernels_are_taken_where_numba_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """Realistic rows never reach the numpy steps the kernels replace (ratios within nearest_int's exact range)."""
    parity.compiled_only(monkeypatch, klayout.kernels, kquants, "_subblocks", "_superblocks", "_importance",
                         "_recode", "_recode_lazy", "_planes")
    x = (np.random.default_rng(9).standard_normal((8, 1024)) * 0.02).astype(np.float32)
    for code in K_TYPES.values():
        for weights in (None, parity.importance(1024, 10)):
            kquants.encode_k(x, code, weights)
