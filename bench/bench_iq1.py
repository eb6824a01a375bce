"""The 1-bit i-quant encoders' CPU against llama.cpp's quantizer on the same tensors (issue 95: <= 1.5x): IQ1_S and
IQ1_M of bench_iq2.py's matrix (1024 x 4096 float32, a fifth exact zeros) with an importance matrix, one thread
each, best of three, the bytes checked equal. Run: ``PYTHONPATH=.:tests:bench NUMBA_NUM_THREADS=1 python
bench/bench_iq1.py``."""

from __future__ import annotations

from bench_iq2 import compare

if __name__ == "__main__":
    compare({"IQ1_S": 19, "IQ1_M": 29})
