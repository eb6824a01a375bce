"""CPU seconds of resumerge's K-quant, IQ4 and IQ3 encoders (resumerge/outputs/gguf/kquants.py, iquants.py,
iq3quants.py: numpy and their numba kernels), and the numpy-only TQ1_0, TQ2_0 and MXFP4 (tquants.py, mxfp4quants.py:
no importance matrix, so one line each), against llama.cpp's own quantizer (``ggml_quantize_chunk`` from the
test-only oracle, one thread) on the same tensor, per type, with and without an importance matrix; bytes checked
equal on every run. With ``--against TREE``, instead this checkout's encoders against another checkout's (e.g.
/work/main), A/B.

    PYTHONPATH=$PWD python bench/bench_kquants.py [ROWS COLUMNS [REPEATS [TYPES]]] [--against TREE]

TYPES: a comma-separated subset of Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,IQ3_XXS,IQ3_S,TQ1_0,TQ2_0,MXFP4 (default
all). The two
quantizers run alternately, REPEATS times each, so that both see the same load.

Prints one line per (type, path): both CPU times (``time.process_time``; the best of REPEATS), Mweights/s and the
ratio. Issue 84's goal (issue 95's for the i-quants): ratio <= 1.5. On random N(0, 0.02) tensors, each type alike;
the same figure on a real route's tensors, each with the type Q4_K_M gives it, is ``bench_kquant_route.py``'s last
step. ``--against``: each checkout's encoder runs in its own child process (two versions of one package cannot
share a process), the children alternating, each timing one encoding after a warm-up one; the ratio is this
checkout's over TREE's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "IQ3_XXS": 18,
         "IQ3_S": 21, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39}
HERE = Path(__file__).resolve().parents[1]
UNREAD = (34, 35, 39)  # the types whose quantizer reads no importance matrix


def tensors(rows: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """The bench's tensor and importance vector (the same in every process: a fixed seed)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)
    weights = (rng.random(columns) ** 2 * 10).astype(np.float32)
    return x, weights


def best(repeats: int, call: object) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(repeats):
        start = time.process_time()
        out = call()  # type: ignore[operator]
        times.append(time.process_time() - start)
    return min(times), out  # type: ignore[return-value]


def child(rows: int, columns: int, code: int, weighted: bool) -> None:
    """One warm-up encoding and one timed one with the checkout on ``sys.path``; prints its CPU seconds and a
    digest of the bytes."""
    import hashlib

    from resumerge.outputs.gguf.encoders import SEARCHED, UNWEIGHTED

    x, weights = tensors(rows, columns)
    imatrix = weights if weighted else None
    encode = {**SEARCHED, **UNWEIGHTED}[code]
    encode(x, code, imatrix)
    seconds, out = best(1, lambda: encode(x, code, imatrix))
    print(seconds, hashlib.sha256(out.tobytes()).hexdigest())


def against(tree: Path, rows: int, columns: int, repeats: int, chosen: list[str]) -> None:
    print(f"{rows}x{columns} float32, this checkout against {tree}, best of {repeats}, CPU seconds")
    for name in chosen:
        for label, weighted in (("plain", False), ("imatrix", True))[:1 if TYPES[name] in UNREAD else 2]:
            times: dict[Path, list[float]] = {HERE: [], tree: []}
            digests = set()
            for _ in range(repeats):
                for root in (tree, HERE):
                    env = {**os.environ, "PYTHONPATH": str(root)}
                    run = subprocess.run([sys.executable, __file__, "--child", str(rows), str(columns),
                                          str(TYPES[name]), str(int(weighted))], env=env, cwd=root, check=True,
                                         capture_output=True, text=True)
                    seconds, digest = run.stdout.split()
                    times[root].append(float(seconds))
                    digests.add(digest)
            assert len(digests) == 1, (name, label)
            theirs_s, ours_s = min(times[tree]), min(times[HERE])
            print(f"{name} {label:8s} {tree.name} {theirs_s:6.3f} s  this {ours_s:6.3f} s  "
                  f"ratio {ours_s / theirs_s:4.2f}", flush=True)


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--child":
        child(int(args[1]), int(args[2]), int(args[3]), bool(int(args[4])))
        return
    tree = None
    if "--against" in args:
        at = args.index("--against")
        tree = Path(args[at + 1]).resolve()
        del args[at:at + 2]
    rows, columns = (int(args[0]), int(args[1])) if len(args) > 1 else (1024, 2048)
    repeats = int(args[2]) if len(args) > 2 else 3
    chosen = args[3].split(",") if len(args) > 3 else list(TYPES)
    if tree is not None:
        against(tree, rows, columns, repeats, chosen)
        return

    from llamacpp_oracle import quantize

    from resumerge.outputs.gguf.encoders import SEARCHED, UNWEIGHTED

    encoders = {**SEARCHED, **UNWEIGHTED}
    x, weights = tensors(rows, columns)
    print(f"{rows}x{columns} float32 ({x.size / 1e6:.1f} Mweights), best of {repeats}, CPU seconds")
    for name in chosen:
        code = TYPES[name]
        for label, imatrix in (("plain", None), ("imatrix", weights))[:1 if code in UNREAD else 2]:
            theirs_t, ours_t = [], []
            for _ in range(repeats):
                theirs_s, theirs = best(1, lambda c=code, w=imatrix: quantize(x, c, w))
                ours_s, ours = best(1, lambda c=code, w=imatrix: encoders[c](x, c, w))
                theirs_t.append(theirs_s)
                ours_t.append(ours_s)
            theirs_s, ours_s = min(theirs_t), min(ours_t)
            assert np.array_equal(ours, theirs), (name, label)
            print(f"{name} {label:8s} llama.cpp {theirs_s:6.2f} s ({x.size / theirs_s / 1e6:5.1f} Mw/s)  "
                  f"resumerge {ours_s:6.2f} s ({x.size / ours_s / 1e6:5.1f} Mw/s)  ratio {ours_s / theirs_s:4.2f}")


if __name__ == "__main__":
    main()
