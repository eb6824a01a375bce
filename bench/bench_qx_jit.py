"""CPU seconds of the K-quant encoders' symmetric searches compiled (resumerge/outputs/gguf/qxloop.py, numba)
against their numpy path, in one process, alternating, on a realistic tensor (normal, 0.02): ``encode_k`` as Q6_K
and Q3_K with and without an importance vector, and the share of Q4_K's (with one) spent in ``ksearch.qp``; bytes
checked equal on every run. Then the kernels' first compilation (a fresh numba cache directory) against loading
them from that cache, each in a child process.

    PYTHONPATH=$PWD nice -n 19 python bench/bench_qx_jit.py [ROWS COLUMNS [REPEATS]]

Defaults 2048 5632 5 (a 1B-class model's ffn matrix). Prints per case the best CPU seconds of REPEATS each way
(``time.process_time``) and the ratio; the compile line is wall and CPU seconds of the first call of every kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from bench_kquants import tensors

HERE = Path(__file__).resolve().parents[1]
CASES = [("Q6_K", 14, False), ("Q6_K", 14, True), ("Q3_K", 11, False), ("Q3_K", 11, True)]


@contextmanager
def numpy_path() -> Iterator[None]:
    """The encoders as they run without numba."""
    from resumerge.outputs.gguf import jit

    real = jit.numba_module
    jit.numba_module = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        jit.numba_module = real  # type: ignore[assignment]


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    out = call()
    return time.process_time() - start, out


def first_call() -> None:
    """Child: every kernel's first call, timed (wall and CPU)."""
    from resumerge.outputs.gguf import ksearch

    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    wall, cpu = time.perf_counter(), time.process_time()
    ksearch.qx_lazy(x, 32, None)
    ksearch.q3(x, 4)
    ksearch.qp(np.abs(x), 15, np.abs(x))
    print(f"{time.perf_counter() - wall:.2f} {time.process_time() - cpu:.2f}")


def main(rows: int, columns: int, repeats: int) -> None:
    from resumerge.outputs.gguf import ksearch
    from resumerge.outputs.gguf.kquants import encode_k

    x, weights = tensors(rows, columns)
    encode_k(x[:8], 14)  # compiled (or loaded from numba's cache) before any timing
    print(f"{rows}x{columns}, best of {repeats} alternating, CPU s: numpy | compiled | ratio")
    for name, code, weighted in CASES:
        imatrix = weights if weighted else None
        plain, fast = [], []
        for _ in range(repeats):
            with numpy_path():
                seconds, want = timed(lambda: encode_k(x, code, imatrix))  # noqa: B023
            plain.append(seconds)
            seconds, got = timed(lambda: encode_k(x, code, imatrix))  # noqa: B023
            fast.append(seconds)
            assert np.array_equal(want, got), name
        label = f"{name} {'imatrix' if weighted else 'plain'}"
        print(f"{label:14} {min(plain):7.2f} | {min(fast):7.2f} | {min(plain) / min(fast):5.1f}x")
    # Q4_K's importance path: the time inside ksearch.qp (its sub-block scales' search) of the whole encoding
    spent = [0.0]
    qp = ksearch.qp

    def counted(*args: Any) -> Any:
        seconds, out = timed(lambda: qp(*args))
        spent[0] += seconds
        return out

    ksearch.qp = counted  # type: ignore[assignment]
    shares: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(repeats):
        for compiled in (False, True):
            spent[0] = 0.0
            if compiled:
                total, _ = timed(lambda: encode_k(x, 12, weights))
            else:
                with numpy_path():
                    total, _ = timed(lambda: encode_k(x, 12, weights))
            shares[compiled].append((spent[0], total))
    ksearch.qp = qp  # type: ignore[assignment]
    for compiled in (False, True):
        inside, total = min(shares[compiled], key=lambda pair: pair[1])
        print(f"Q4_K imatrix {'compiled' if compiled else 'numpy   '}: qp {inside:.3f} s of {total:.2f} s")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(HERE)}
        for label in ("cold (compiled)", "cached (loaded)"):
            out = subprocess.run([sys.executable, __file__, "--first-call"], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            print(f"kernels' first call, {label}: {out[0]} s wall, {out[1]} CPU s")


if __name__ == "__main__":
    if sys.argv[1:] == ["--first-call"]:
        first_call()
    else:
        numbers = [int(a) for a in sys.argv[1:]]
        main(*(numbers + [2048, 5632, 5][len(numbers):]))
