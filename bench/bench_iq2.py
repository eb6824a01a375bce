"""The 2-bit i-quant encoders' CPU against llama.cpp's quantizer on the same tensors (issue 95: <= 1.5x): IQ2_XXS,
IQ2_XS and IQ2_S of a 1024 x 4096 float32 matrix (Gaussian, a fifth of its values exact zeros as TIES/DARE leave
them) with an importance matrix, one thread each: resumerge's ``encode_iq`` (numba kernels, compiled and warm) and
``ggml_quantize_chunk`` (llama-cpp-py-sync 0.11739, tests/llamacpp_oracle.py). Best of three; the bytes checked
equal. Run: ``PYTHONPATH=.:tests NUMBA_NUM_THREADS=1 python bench/bench_iq2.py``."""

from __future__ import annotations

import time

import numpy as np
from llamacpp_oracle import quantize

from resumerge.outputs.gguf.iquants import encode_iq


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def matrix() -> tuple[np.ndarray, np.ndarray]:
    """The benched matrix (1024 x 4096, a fifth exact zeros) and its importance."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 4096)).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = 0
    weights = (rng.random(4096) ** 2 + 0.01).astype(np.float32)
    return x, weights


def compare(types: dict[str, int]) -> None:
    """Each of ``types`` (name -> ggml type) encoded by both, the CPU printed."""
    x, weights = matrix()
    for name, code in types.items():
        ours = encode_iq(x[:16], code, weights)  # compile (or load the cached kernels), build the grid's tables
        assert np.array_equal(ours, quantize(x[:16], code, weights))
        resumerge_s = best(lambda code=code: encode_iq(x, code, weights))
        llama_s = best(lambda code=code: quantize(x, code, weights))
        print(f"{name}: resumerge {resumerge_s:.2f} s CPU, llama.cpp {llama_s:.2f} s CPU, "
              f"ratio {resumerge_s / llama_s:.2f}x ({x.size / 1e6 / resumerge_s:.1f} vs {x.size / 1e6 / llama_s:.1f} "
              "Mweights/s)")


def main() -> None:
    compare({"IQ2_XXS": 16, "IQ2_XS": 17, "IQ2_S": 22})


if __name__ == "__main__":
    main()
