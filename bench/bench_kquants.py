"""CPU seconds of resumerge's K-quant encoders (resumerge/outputs/gguf/kquants.py, numpy) against llama.cpp's own
quantizer (``ggml_quantize_chunk`` from the test-only oracle, one thread) on the same tensor, per type, with and
without an importance matrix; bytes checked equal on every run.

    PYTHONPATH=$PWD python bench/bench_kquants.py [ROWS COLUMNS [REPEATS [TYPES]]]

TYPES: a comma-separated subset of Q2_K,Q3_K,Q4_K,Q5_K,Q6_K (default all). The two quantizers run alternately,
REPEATS times each, so that both see the same load.

Prints one line per (type, path): both CPU times (``time.process_time``; the best of REPEATS), Mweights/s and the
ratio. Issue 84's goal: ratio <= 1.5.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llamacpp_oracle import quantize

from resumerge.outputs.gguf.kquants import encode_k

TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def best(repeats: int, call: object) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(repeats):
        start = time.process_time()
        out = call()  # type: ignore[operator]
        times.append(time.process_time() - start)
    return min(times), out  # type: ignore[return-value]


def main() -> None:
    rows, columns = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (1024, 2048)
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else list(TYPES)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)
    weights = (rng.random(columns) ** 2 * 10).astype(np.float32)
    print(f"{rows}x{columns} float32 ({x.size / 1e6:.1f} Mweights), best of {repeats}, CPU seconds")
    for name in chosen:
        code = TYPES[name]
        for label, imatrix in (("plain", None), ("imatrix", weights)):
            theirs_t, ours_t = [], []
            for _ in range(repeats):
                theirs_s, theirs = best(1, lambda c=code, w=imatrix: quantize(x, c, w))
                ours_s, ours = best(1, lambda c=code, w=imatrix: encode_k(x, c, w))
                theirs_t.append(theirs_s)
                ours_t.append(ours_s)
            theirs_s, ours_s = min(theirs_t), min(ours_t)
            assert np.array_equal(ours, theirs), (name, label)
            print(f"{name} {label:8s} llama.cpp {theirs_s:6.2f} s ({x.size / theirs_s / 1e6:5.1f} Mw/s)  "
                  f"resumerge {ours_s:6.2f} s ({x.size / ours_s / 1e6:5.1f} Mw/s)  ratio {ours_s / theirs_s:4.2f}")


if __name__ == "__main__":
    main()
