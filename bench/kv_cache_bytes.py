"""The KV cache a layer-streamed generation holds on a sliding-window family, as the plan counts it
(``KVShape.cache_bytes``, the figure the stores are sized by; computed, not timed): Gemma-3-1B's shape (26 decoder
layers, one key/value head of 256 values, a 512-position window on every layer but each sixth; float32 keys and
values), 8 requests of 1024 + 256, 4096 + 256 and 8192 + 512 positions, against every position of every layer kept.

    PYTHONPATH=$PWD python bench/kv_cache_bytes.py [--requests N]
"""

from __future__ import annotations

import argparse

from resumerge.analyses.evaluation.kvcache import KVShape

LAYERS, HEADS, WIDTH, WINDOW, GLOBAL_EVERY = 26, 1, 256, 512, 6
ROOMS = ((1024, 256), (4096, 256), (8192, 512))  # (context, new tokens) a request
MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    windows = tuple(0 if (layer + 1) % GLOBAL_EVERY == 0 else WINDOW for layer in range(LAYERS))
    windowed, whole = KVShape(LAYERS, HEADS, WIDTH, windows), KVShape(LAYERS, HEADS, WIDTH)
    print("| positions a request | every position kept | the window's | smaller |")
    print("|---|---|---|---|")
    for context, new in ROOMS:
        kept = args.requests * windowed.cache_bytes(context + new) / MIB
        every = args.requests * whole.cache_bytes(context + new) / MIB
        print(f"| {context} + {new} | {every:.0f} MiB | {kept:.0f} MiB | {every / kept:.1f}x |")


if __name__ == "__main__":
    main()
