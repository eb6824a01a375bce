"""The forward pass of ``resumerge check`` alone, in this process: merge, base and one parent of
``bench/bench_check.py``'s work folder (run that first), its four texts.

Usage::

    THREADS=2 [OMP_WAIT_POLICY=PASSIVE] PYTHONPATH=TREE python bench/bench_check_forward.py

Prints the pass's wall and CPU seconds with torch's thread count (``THREADS``, default 1) and the NLLs. Set
``OMP_WAIT_POLICY`` in the environment: OpenMP reads it once, as torch loads.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    import torch
    from realmodel import smollm2_folder

    from resumerge.analyses.check.models import find_models
    from resumerge.forward.compared.passes import forward_pass, streams_of
    from resumerge.forward.text.texts import load_tokenizer, sequences

    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    work = Path(tempfile.gettempdir()) / "resumerge-bench-check"
    models = find_models(work / "merge", smollm2_folder(), (work / "parent0",))
    tokens = sequences(load_tokenizer([m.opened.directory for m in models]), work / "texts.txt")
    streams = streams_of(models)
    cpu, wall = time.process_time(), time.perf_counter()
    figures = forward_pass(models, streams, tokens, Path(tempfile.mkdtemp()))
    print(f"threads {torch.get_num_threads()} OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', '-')}: forward "
          f"{time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU, NLL "
          f"{[round(x, 6) for x in figures.nll]}")


if __name__ == "__main__":
    main()
