"""What a GGUF run's baseline measurement names per set of compiled kernels: for each kernel spec given (as
:func:`resumerge.merge.engine.footprint.kernel_spec` writes it: ``"12,14w"``; ``-`` for none), one fresh interpreter
importing the run's modules and loading those kernels, as :func:`resumerge.machine.memory.baseline.fresh_baseline`
measures it, and that process's RSS and CPU seconds. Run it twice: the first pass over a cold numba cache compiles
the kernels (their compiler's memory counts in that process), the second loads them from disk as a later run does.

Usage::

    python bench/bench_kernel_baseline.py - 12 12,14 10,11,12,13,14,10w,11w,12w,13w,14w 16w 12w,16w
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from resumerge.machine.memory.baseline import _MEASURE
from resumerge.merge.engine.footprint import RUN_MODULES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="kernel specs (kernel_spec's form), '-' for no kernels")
    args = parser.parse_args()
    for spec in args.specs:
        modules = [*RUN_MODULES, *([f"resumerge.outputs.gguf.encoders:warm_kernels:{spec}"] if spec != "-" else [])]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(sys.path), json.dumps(modules)],
                              capture_output=True, text=True, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        lines = done.stdout.split()
        if done.returncode != 0 or not lines:
            print(f"{spec:40s} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        print(f"{spec:40s} {int(lines[-1]) / 2**20:7.1f} MB  {cpu:5.2f} CPU s", flush=True)


if __name__ == "__main__":
    main()
