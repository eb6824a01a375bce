"""The kept block-FP8 merge's per-tensor kernels on one 5632x2048 tensor, in CPU milliseconds (issue 43).

Usage: ``python bench/bench_fp8_kernels.py [--repeats N]``

Times, on the calling thread alone (``serial_kernels``, as the engine's workers run them), each step a kept-FP8 linear
merge pays per tensor: the decode of one input into a fresh float32 tensor and into a reused one (the engine's
workspace, ``resumerge.merge.engine.workspace``), the linear method's accumulation with a fresh accumulator and with a
reused one (``MergeContext.result_buffer``), and the encode back to codes and scales. Prints the minimum and the median
of thread CPU time over ``--repeats`` calls: CPU time, not wall, since the machine is shared (a fresh buffer's cost
is mostly the kernel zero-filling its pages, which thread CPU time counts as system time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from resumerge.inputs.kernels import serial_kernels
from resumerge.inputs.quant import fp8_block
from resumerge.merge.methods.linear import linear
from resumerge.merge.methods.spec import MergeContext

ROWS, COLS, BLOCK = 5632, 2048, (128, 128)


def cpu_ms(step: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(minimum, median) thread CPU milliseconds of ``step`` over ``repeats`` calls, after one warm-up call."""
    step()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        step()
        times.append((time.thread_time() - start) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (ROWS, COLS), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
    fp8 = codes.view(torch.float8_e4m3fn)
    scale = torch.rand((ROWS // BLOCK[0], COLS // BLOCK[1]), generator=g) * 1e-3 + 1e-5
    decoded = fp8_block.decode(fp8, scale, BLOCK)
    other = decoded.flip(0).contiguous()
    buffer, result = torch.empty_like(decoded), torch.empty_like(decoded)
    params = [{"weight": 0.5}, {"weight": 0.5}]

    def merge(lend: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor] | None) -> torch.Tensor:
        return linear(MergeContext([decoded, other], None, params, {"normalize": True}, lend=lend))

    steps: dict[str, Callable[[], object]] = {
        "decode, fresh buffer": lambda: fp8_block.decode(fp8, scale, BLOCK),
        "decode, reused buffer": lambda: fp8_block.decode(fp8, scale, BLOCK, out=buffer),
        "linear, fresh accumulator": lambda: merge(None),
        "linear, reused accumulator": lambda: merge(lambda use, shape, dtype: result.view(shape)),
        "encode": lambda: fp8_block.encode(decoded, BLOCK),
    }
    print(f"one {ROWS}x{COLS} block-FP8 tensor, thread CPU ms over {args.repeats} calls\n\n| step | min | median |\n"
          "|---|---|---|")
    with serial_kernels():
        for name, step in steps.items():
            low, middle = cpu_ms(step, args.repeats)
            print(f"| {name} | {low:.1f} | {middle:.1f} |", flush=True)


if __name__ == "__main__":
    main()
