"""CPU seconds of resumerge's K-quant encoding *outside* its candidate searches (resumerge/outputs/gguf/kquants.py's
layouts, weights, scales, recoding and packing, and klayout.py's kernels), per type, with and without an importance
vector: each child process encodes once with the searches (``ksearch.qkx``, ``qx_lazy``, ``q3``, ``qp``, ``qx``)
recording their results, then encodes again REPEATS times with those results replayed, and prints the full encoding's
CPU s and the best replay's (the rest of the encoding). Checkouts given with ``--against`` run alternately with this
one, each in its own child process, with the same tensor (a fixed seed).

    PYTHONPATH=$PWD python bench/bench_kquant_glue.py [ROWS COLUMNS [REPEATS [TYPES]]] [--against TREE]
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_kquants import TYPES, tensors

SEARCHES = ("qkx", "qx_lazy", "q3", "qp", "qx")
HERE = Path(__file__).resolve().parents[1]


def child(rows: int, columns: int, code: int, weighted: bool, repeats: int) -> None:
    from resumerge.outputs.gguf import kquants, ksearch

    x, vector = tensors(rows, columns)
    weights = vector if weighted else None
    kquants.encode_k(x[:16], code, weights)  # compiled kernels loaded
    tape: dict[str, list[Any]] = collections.defaultdict(list)
    at: collections.Counter[str] = collections.Counter()
    state = {"replay": False, "depth": 0}

    def taped(name: str, search: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if state["replay"]:
                at[name] += 1
                return tape[name][at[name] - 1]
            state["depth"] += 1
            try:
                result = search(*args, **kwargs)
            finally:
                state["depth"] -= 1
            if state["depth"] == 0:  # a search's own calls of another are its own
                tape[name].append(result)
            return result
        return call

    for name in SEARCHES:
        setattr(ksearch, name, taped(name, getattr(ksearch, name)))
    start = time.process_time()
    kquants.encode_k(x, code, weights)
    full = time.process_time() - start
    state["replay"] = True
    rest = []
    for _ in range(repeats):
        at.clear()
        start = time.process_time()
        kquants.encode_k(x, code, weights)
        rest.append(time.process_time() - start)
    print(full, min(rest))


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--child":
        child(int(args[1]), int(args[2]), int(args[3]), bool(int(args[4])), int(args[5]))
        return
    trees = [HERE]
    if "--against" in args:
        at = args.index("--against")
        trees.insert(0, Path(args[at + 1]).resolve())
        del args[at:at + 2]
    rows, columns = (int(args[0]), int(args[1])) if len(args) > 1 else (2048, 5632)
    repeats = int(args[2]) if len(args) > 2 else 3
    chosen = args[3].split(",") if len(args) > 3 else [name for name in TYPES if name.endswith("_K")]
    print(f"{rows}x{columns} float32, CPU s: the whole encoding | outside the searches (best of {repeats} replays)")
    for name in chosen:
        for label, weighted in (("plain", False), ("imatrix", True)):
            cells = []
            for root in trees:
                env = {**os.environ, "PYTHONPATH": str(root)}
                run = subprocess.run([sys.executable, __file__, "--child", str(rows), str(columns),
                                      str(TYPES[name]), str(int(weighted)), str(repeats)], env=env, cwd=root,
                                     check=True, capture_output=True, text=True)
                full, rest = (float(v) for v in run.stdout.split())
                cells.append(f"{root.name} {full:6.3f} | {rest:6.4f}")
            print(f"{name} {label:8s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
