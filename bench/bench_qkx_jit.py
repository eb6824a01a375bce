"""CPU seconds of the K-quant encoders whose scale search is ``make_qkx2/3_quants`` (Q2_K, Q4_K, Q5_K), with that
search compiled (resumerge/outputs/gguf/qkxloop.py, numba) against its numpy path, in one process, alternated;
bytes checked equal on every run. Then the search alone on one encoder chunk, and the kernel's first call in a
fresh process: compiled (an empty cache directory) and loaded from numba's cache on disk.

    PYTHONPATH=$PWD nice -n 19 python bench/bench_qkx_jit.py [ROWS COLUMNS [REPEATS [TYPES]]]

Default 2048x5632 float32 N(0, 0.02) (a 1.5B model's MLP matrix: Q4_K_M-sized), an importance vector, REPEATS 3;
TYPES a comma-separated subset of Q2_K,Q4_K,Q5_K. Prints per (type, path) the best CPU seconds
(``time.process_time``) of each side and the ratio numpy / compiled.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from unittest import mock

import numpy as np
from bench_kquants import tensors

TYPES = {"Q2_K": 10, "Q4_K": 12, "Q5_K": 13}
FIRST_CALL = """
import time
import numpy as np
from resumerge.outputs.gguf import ksearch, qkxloop
import numba  # its import (~0.3 s) apart from the compilation
x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
start = time.process_time()
ksearch.qkx(x, np.abs(x), 15, -1.0, 0.1, 20, mad=False, v3=False)
print(time.process_time() - start)
"""


def first_calls() -> None:
    """The kernel's first call in a fresh process with an empty cache directory, then again with it filled."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold (compiled)", "cached (loaded)", "cached (loaded)"):
            run = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, check=True, capture_output=True,
                                 text=True)
            print(f"first call, {label}: {float(run.stdout):.3f} CPU s", flush=True)


def main() -> None:
    from resumerge.outputs.gguf import qkxloop
    from resumerge.outputs.gguf.kquants import encode_k

    args = sys.argv[1:]
    rows, columns = (int(args[0]), int(args[1])) if len(args) > 1 else (2048, 5632)
    repeats = int(args[2]) if len(args) > 2 else 3
    chosen = args[3].split(",") if len(args) > 3 else list(TYPES)
    x, weights = tensors(rows, columns)
    if qkxloop._kernel() is None:
        raise SystemExit("numba is not installed: pip install 'resumerge[kquants]'")
    encode_k(x[:256], TYPES[chosen[0]], weights)  # the kernel compiled or loaded before any timing
    print(f"{rows}x{columns} float32 ({x.size / 1e6:.1f} Mweights), best of {repeats}, CPU seconds", flush=True)
    for name in chosen:
        code = TYPES[name]
        for label, imatrix in (("plain", None), ("imatrix", weights)):
            times: dict[str, list[float]] = {"numpy": [], "compiled": []}
            outs = []
            for _ in range(repeats):
                for side in times:
                    numpy_only = mock.patch.object(qkxloop, "_kernel", lambda: None)
                    with numpy_only if side == "numpy" else contextlib.nullcontext():
                        start = time.process_time()
                        outs.append(encode_k(x, code, imatrix))
                        times[side].append(time.process_time() - start)
            assert all(np.array_equal(outs[0], out) for out in outs), (name, label)
            slow, fast = min(times["numpy"]), min(times["compiled"])
            print(f"{name} {label:8s} numpy {slow:6.3f} s  compiled {fast:6.3f} s  ratio {slow / fast:4.2f}",
                  flush=True)
    searches(x)
    first_calls()


def searches(x: np.ndarray) -> None:
    """The search alone over one encoder chunk (256 super-blocks of 8 sub-blocks), numpy against compiled."""
    from resumerge.outputs.gguf import ksearch

    sub = np.ascontiguousarray(x[:256, :256].T.reshape(8, 32, 256).transpose(1, 0, 2)).reshape(32, -1)
    weights = np.abs(sub) + np.float32(0.01)
    for label, args in (("Q4_K plain", (15, -1.0, 0.1, 20, False, False)),
                        ("Q4_K imatrix", (15, -0.9, 0.05, 36, False, True))):
        times: dict[str, list[float]] = {"numpy": [], "compiled": []}
        for _ in range(20):
            for side, search in (("numpy", ksearch.qkx_numpy), ("compiled", ksearch.qkx)):
                start = time.process_time()
                for _ in range(10):
                    search(sub, weights, *args[:4], mad=args[4], v3=args[5])
                times[side].append((time.process_time() - start) / 10)
        slow, fast = min(times["numpy"]), min(times["compiled"])
        print(f"search alone, {label}, {sub.shape[1]} sub-blocks: numpy {slow * 1e3:.2f} ms  compiled "
              f"{fast * 1e3:.2f} ms  ratio {slow / fast:4.2f}", flush=True)


if __name__ == "__main__":
    main()
