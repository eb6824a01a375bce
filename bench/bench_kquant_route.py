"""A merge straight to Q4_K_M with an importance matrix computed on the merge (issue 84), against the peer route.

Usage::

    python bench/bench_kquant_route.py [--work DIR] [--texts N] [--layers N] [--peer-threads N] [--peer-batch N]
                                       [--numba cold|warm|both] [--no-encoding | --encoding-only]

Generates two llama bfloat16 models of about 1 GB each once under ``--work`` (``resumerge.cli.modelgen``: hidden
2048, intermediate 5632, ``--layers`` layers, vocabulary 49152, untied head, SmolLM2's tokenizer; random normal
weights), a texts file of ``--texts`` lines, and a linear 0.5/0.5 config, then times each route's commands (wall,
CPU = user + system of the command and its children, peak RSS of its largest process) and samples the disk the
route holds beside its final GGUF every 0.2 s:

- ``resumerge``: one command, ``resumerge run --out-type gguf --gguf-type q4_k_m --imatrix-texts TEXTS`` (the
  matrix computed on the merge never written, then the merge encoded with it; fully durable). Its K-quant encoders
  may be compiled by numba (``resumerge/outputs/gguf/jit.py``, cached on disk): a machine's first run compiles
  them, later runs load the cache. ``--numba cold`` times the run with a fresh ``NUMBA_CACHE_DIR`` under
  ``--work``; ``warm`` with that folder already filled by one untimed run of the same command; ``both`` (the
  default) runs cold, then warm in the folder the cold run filled (the cold run is the warm one's warm-up).
  Whether numba imports, and how many files each run left in the cache, are printed.
- ``peer``: ``mergekit-yaml`` (the float merge written as bfloat16 safetensors), the merge as an F16 GGUF,
  llama-imatrix's pass over the same texts on that F16 GGUF, then llama.cpp's library quantizer
  (``llama_model_quantize`` of PyPI ``llama-cpp-py-sync``, loaded as the tests load it,
  ``tests/llamacpp_oracle.py``) to Q4_K_M with the matrix that pass wrote. llama.cpp's ``convert_hf_to_gguf.py``
  is not installed here, so the F16 GGUF is written by resumerge (``run --out-type gguf --gguf-type f16`` of the
  float merge). ``llama-imatrix`` is not installed either (the wheel ships the libraries, not the tools), so its
  pass is the oracle's (:func:`llamacpp_oracle.imatrix_of_forward`): llama.cpp's library forward of the F16 GGUF
  on ``--peer-threads`` threads, each text tokenized by llama.cpp's own tokenizer and its own sequence, the texts
  decoded together in batches of up to ``--peer-batch`` tokens (2048, llama-imatrix's default ``n_batch``: it
  decodes ``n_batch / n_ctx`` chunks at once; one decode a text would read the whole model once a text), the input
  columns' squares summed in ``cb_eval`` under llama-imatrix's rules, written in llama.cpp's GGUF imatrix format.
  Its KV cache is F32 and flash attention off (llama-imatrix's defaults: F16, auto), so that its sums can be
  compared with resumerge's. Its collector (the ``cb_eval`` callback's body) is Python where llama-imatrix's is
  C++, and the process starts Python: against the peer, by the callback's seconds and the start's, both printed
  beside the step (about 3 s at 6 layers, session 47). The peer's totals are printed with and without the matrix
  pass, so that either ratio can be read (until session 47 the quantizer was handed resumerge's matrix and no
  pass was timed, in the peer's favour). The quantizer and the pass run on ``--peer-threads`` threads, every
  hardware thread by default as llama-quantize and llama-imatrix do.
  The two matrices are compared (entries, counts, the sums' differences) and the two Q4_K_M files tensor by
  tensor. On the F16 GGUF the sums differ by up to ~1e-3 of an entry's largest value: ggml's F16 products round
  their float32 inputs to F16, so llama.cpp's activations are not the float merge's (on an F32 GGUF of the same
  merge the two matrices agree to ~4e-6, within float32 tolerance); and the few super-blocks whose search lands
  elsewhere under the other matrix differ in the two files, while the same matrix gives the same bytes (the
  encoding comparison below checks it on every tensor).

Then (``--encoding``, the default; ``--encoding-only`` on a work folder the routes already filled) issue 84's
other figure, the encoding's CPU seconds against llama.cpp's quantizer's for the same tensors: every tensor of the
peer's F16 GGUF that Q4_K_M stores as a K type, with the type llama-quantize chose for it, encoded by resumerge's
``outputs/gguf/kquants.encode_k`` and by llama.cpp's ``ggml_quantize_chunk`` in one child process on one thread,
tensor by tensor alternating, without and with the importance matrix (the peer's; ``token_embd`` and ``output``
have no entry and are encoded without one in both passes, as both quantizers do), bytes checked equal. CPU
seconds by ``time.process_time``, after an untimed encoding of a few rows of each type (numba's compilation or
cache load, if the encoders use it, is not in the figure).

Prints each command's figures, each route's totals and their ratios. Run it niced on a shared machine: the load
average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from launcher import launched  # noqa: E402

# llama-imatrix's pass through llama.cpp's library (the oracle's collector; module docstring): the texts tokenized
# by llama.cpp, its forward of the F16 GGUF watched in cb_eval, the matrix written in llama.cpp's GGUF format.
# Prints its parts' wall seconds: library load, tokenizing, forward (with, of it, the Python callback), writing.
IMATRIX_PASS = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from llamacpp_oracle import imatrix_of_forward, library, tokenize\n"
    "from resumerge.outputs.gguf.imatrix import ImatrixEntry, imatrix_bytes\n"
    "model, texts, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])\n"
    "threads, batch = int(sys.argv[4]), int(sys.argv[5])\n"
    "started = time.perf_counter()\n"
    "library()\n"
    "loaded = time.perf_counter()\n"
    "ids = tokenize(model, [line for line in texts.read_text().splitlines() if line.strip()])\n"
    "tokenized = time.perf_counter()\n"
    "spent = []\n"
    "found = imatrix_of_forward(model, ids, n_threads=threads, batch_tokens=batch, spent=spent)\n"
    "forward = time.perf_counter()\n"
    "entries = {name: ImatrixEntry(sums, counts.astype('float32')) for name, (sums, counts) in found.items()}\n"
    "out.write_bytes(imatrix_bytes(entries, [str(texts)], len(ids), max(map(len, ids))))\n"
    "print('parts', loaded - started, tokenized - loaded, forward - tokenized, spent[0],\n"
    "      time.perf_counter() - forward, sum(map(len, ids)))\n"
)
# llama.cpp's quantizer through its library, given the importance matrix as llama-quantize gives it: argv the F16
# GGUF, the output, the matrix, the threads, the file type (llama_ftype: 15 is Q4_K_M).
QUANTIZE = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from llamacpp_oracle import quantize_model\n"
    "from resumerge.outputs.gguf.imatrix import read_imatrix\n"
    "quantize_model(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[5]), imatrix=read_imatrix(sys.argv[3]),\n"
    "               nthread=int(sys.argv[4]))\n"
)
# One thread everywhere in the encoding comparison's child (numpy's BLAS, OpenMP, numba): CPU s on one core each.
_ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                      "NUMBA_NUM_THREADS")}
LINES = ("the quick brown fox jumps over the lazy dog and runs into the woods where nobody has been for years",
         "three plus four is seven and seven times six is forty two which is the answer to many questions",
         "def add(a, b): return a + b  # the sum of two numbers, written in python for the example",
         "paris is the capital of france, berlin the capital of germany and rome the capital of italy")
K_TYPES = {10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


class DiskPeak:
    """The most bytes the folders held at once beyond ``beyond`` (the final GGUF), sampled every 0.2 s."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders, self.peak, self._stop = folders, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.held())

    def held(self) -> int:
        total = 0
        for folder in self.folders:
            for root, _, files in os.walk(folder):
                for name in files:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(root, name)).st_blocks * 512
        return total

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.held())


class Step(NamedTuple):
    """One command's figures: wall s, CPU s (its own and its children's), peak RSS bytes, what it printed."""

    wall: float
    cpu: float
    peak: int
    stdout: str


def measured(label: str, argv: list[str], env: dict[str, str] | None = None, *, quiet: bool = False) -> Step:
    """``argv`` run niced through the launcher; exits with its stderr on failure."""
    done = launched(argv, env, cwd=ROOT, nice=True)
    if done.code != 0:
        raise SystemExit(f"{label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    wall, cpu, peak = done.wall, done.cpu, done.peak_rss
    if not quiet:
        print(f"  {label}: wall {wall:.1f} s, CPU {cpu:.1f} s, peak RSS {peak / 2**30:.2f} GiB "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return Step(wall, cpu, peak, done.stdout)


def make_inputs(work: Path, layers: int, texts: int) -> tuple[Path, Path]:
    """The two models (made once), the texts file and the merge config."""
    config = linear_pair(work, layers, 2048, 5632)
    text_file = work / "texts.txt"
    text_file.write_text("\n".join(LINES[i % len(LINES)] for i in range(texts)) + "\n")
    return config, text_file


def linear_pair(work: Path, layers: int, hidden: int, intermediate: int) -> Path:
    """Two generated llama bfloat16 models under ``work`` (made once: 16 heads, 4 KV heads, SmolLM2's vocabulary of
    49152 and its byte-level BPE tokenizer, a GGUF vocabulary resumerge builds; modelgen's own is not byte-level)
    and their linear 0.5/0.5 merge config."""
    import torch
    from realmodel import smollm2_folder

    from resumerge.cli.modelgen import ModelSpec, make_model

    vocab_from = smollm2_folder()
    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=intermediate, vocab=49152, heads=16, kv_heads=4,
                     dtype=torch.bfloat16, shard_bytes=450_000_000, tokenizer=False)
    models = []
    for seed, name in enumerate("ab"):
        path = work / f"models-{layers}-{hidden}-{intermediate}" / name
        if not (path / "config.json").exists():
            shutil.rmtree(path, ignore_errors=True)
            make_model(path, spec, seed=seed + 1)
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(vocab_from / file, path / file)
        models.append(path)
    config = work / "merge.yml"
    config.write_text("merge_method: linear\ndtype: bfloat16\nmodels:\n" + "".join(
        f"  - model: {m}\n    parameters:\n      weight: 0.5\n" for m in models))
    return config


def numba_line() -> str:
    """Whether numba imports in this interpreter (the one every command runs), and its version."""
    try:
        import numba
    except ImportError as error:  # not installed, or built for another numpy
        return f"numba not importable ({error}): the encoders take their numpy path"
    return f"numba {numba.__version__} importable"


def cache_line(folder: Path) -> str:
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.exists() else []
    return f"numba cache {folder.name}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB"


def digest(path: Path) -> str:
    found = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 24), b""):
            found.update(chunk)
    return found.hexdigest()


class Ours(NamedTuple):
    """One timed resumerge run: its figures, its GGUF's size, its extra disk at the peak, its folder."""

    step: Step
    final: int
    extra: int
    folder: Path


def run_ours(label: str, folder: Path, config: Path, texts: Path, args: argparse.Namespace, env: dict[str, str], *,
             timed: bool = True) -> Ours:
    """``resumerge run … q4_k_m --imatrix-texts`` into a fresh ``folder``."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    argv = [sys.executable, "-m", "resumerge", "run", str(config), str(folder / "out"), "--state-dir",
            str(folder / "state"), "--out-type", "gguf", "--gguf-type", "q4_k_m", "--imatrix-texts", str(texts),
            "--max-memory", args.max_memory]
    with DiskPeak([folder]) as disk:
        step = measured(label, argv, env, quiet=not timed)
    final = (folder / "out" / "model.gguf").stat().st_size
    ours = Ours(step, final, disk.peak - final, folder)
    if timed:
        print(f"  total: wall {step.wall:.1f} s, CPU {step.cpu:.1f} s, peak RSS {step.peak / 2**30:.2f} GiB, GGUF "
              f"{final / 1e9:.3f} GB, extra disk at its peak {ours.extra / 1e9:.3f} GB", flush=True)
    return ours


def matrix_entries(path: Path) -> dict[str, tuple[object, object]]:
    """A GGUF importance matrix's entries as written: per weight, (sums [n_mat, n_in], counts [n_mat])."""
    import gguf
    import numpy as np

    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(path).tensors}
    found: dict[str, tuple[object, object]] = {}
    for name, values in tensors.items():
        if name.endswith(".in_sum2"):
            counts = tensors[name.replace(".in_sum2", ".counts")].reshape(-1)
            found[name.removesuffix(".in_sum2")] = values.reshape(counts.size, -1), counts
    return found


def compare_matrices(ours: Path, peer: Path) -> None:
    """resumerge's matrix (on the merge never written) against the peer's pass (on its F16 GGUF): the entries,
    their counts, and the sums' largest relative difference (issue 84: equal to float tolerance)."""
    import numpy as np

    mine, theirs = matrix_entries(ours), matrix_entries(peer)
    same_names = sorted(mine) == sorted(theirs)
    common = sorted(set(mine) & set(theirs))
    counts_equal = all(np.array_equal(mine[n][1], theirs[n][1]) for n in common)
    worst, close, scaled = 0.0, True, []
    for name in common:
        a, b = np.asarray(mine[name][0]), np.asarray(theirs[name][0])
        if a.shape != b.shape:
            close = False
            continue
        worst = max(worst, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30))))
        scaled.append((np.abs(a - b) / float(np.abs(b).max())).ravel())
        close = close and bool(np.allclose(a, b, rtol=2e-4, atol=1e-6 * float(np.abs(b).max())))
    tokens = int(np.asarray(theirs[common[0]][1]).sum()) if common else 0
    spread = np.concatenate(scaled) if scaled else np.zeros(1)
    print(f"  matrices, resumerge's against the peer's: {len(common)} entries in common "
          f"({'the same names' if same_names else f'{len(mine)} vs {len(theirs)} entries'}), counts "
          f"{'equal' if counts_equal else 'DIFFER'} ({tokens} rows an entry); sums' largest relative difference "
          f"{worst:.2e}, largest / median difference over the entry's largest value {spread.max():.1e} / "
          f"{np.median(spread):.1e}: {'within' if close else 'OUTSIDE'} float32 tolerance (rtol 2e-4)"
          + ("" if close else "; llama.cpp's F16 products round their float32 inputs to F16, so the activations "
             "the peer's pass sees differ from the float merge's (on an F32 GGUF they agree within it)"), flush=True)


def compare_ggufs(ours: Path, peer: Path) -> None:
    """The two Q4_K_M files tensor by tensor: same names and types, and the data's super-blocks that differ."""
    import gguf
    import numpy as np
    from llamacpp_oracle import tensors_of

    mine, theirs = tensors_of(ours), tensors_of(peer)
    differing = []
    types_equal = sorted(mine) == sorted(theirs) and all(mine[n].kind == theirs[n].kind for n in theirs)
    for name in sorted(set(mine) & set(theirs)):
        a, b = mine[name], theirs[name]
        if a.kind != b.kind or a.data == b.data:
            continue
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[a.kind]][1]
        rows_a = np.frombuffer(a.data, np.uint8).reshape(-1, block)
        rows_b = np.frombuffer(b.data, np.uint8).reshape(-1, block)
        differing.append(f"{name} {int((rows_a != rows_b).any(axis=1).sum())}/{len(rows_a)} blocks")
    identical = sum(1 for n in theirs if n in mine and mine[n].kind == theirs[n].kind
                    and mine[n].data == theirs[n].data)
    listed = ", ".join(differing[:6]) + (" …" if len(differing) > 6 else "")
    print(f"  Q4_K_M, resumerge's against the peer's: {identical}/{len(theirs)} tensors' data identical, types "
          f"{'equal' if types_equal else 'DIFFER'}"
          + (f"; differing (the matrices differ; the same matrix gives the same bytes, below): {listed}"
             if differing else ""), flush=True)


def encoding_child(f16: Path, q4: Path, matrix: Path) -> None:
    """Issue 84's encoding figure, in this (one-thread) process: every K-type tensor of the peer's Q4_K_M encoded
    from the F16 GGUF's values by resumerge's ``encode_k`` and by llama.cpp's ``ggml_quantize_chunk``, alternating
    tensor by tensor, without and with the matrix; CPU s per type and in all, bytes checked equal (and, with the
    matrix, equal to what ``llama_model_quantize`` wrote)."""
    import gguf
    import numpy as np
    from llamacpp_oracle import quantize, tensors_of

    from resumerge.outputs.gguf.imatrix import read_imatrix
    from resumerge.outputs.gguf.kquants import encode_k

    stored = tensors_of(q4)
    weights = read_imatrix(matrix)
    floats = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    chosen = [(name, gguf.GGMLQuantizationType[s.kind].value) for name, s in stored.items()
              if gguf.GGMLQuantizationType[s.kind].value in K_TYPES]
    for code in sorted({code for _, code in chosen}):  # untimed: numba's compilation or cache load, if any
        name = next(n for n, c in chosen if c == code)
        few = np.asarray(floats[name].data, dtype=np.float32).reshape(-1, int(stored[name].ne[0]))[:8]
        for imatrix in (None, np.ones(few.shape[1], np.float32)):
            encode_k(few, code, imatrix)
            quantize(few, code, imatrix)
    for with_matrix in (False, True):
        theirs_s: dict[int, float] = {}
        ours_s: dict[int, float] = {}
        counted: dict[int, int] = {}
        unlike_stored = []
        for i, (name, code) in enumerate(chosen):
            x = np.asarray(floats[name].data, dtype=np.float32).reshape(-1, int(stored[name].ne[0]))
            w = weights.get(name) if with_matrix else None
            times = {}
            for side in (("ours", "theirs") if i % 2 else ("theirs", "ours")):
                start = time.process_time()
                out = encode_k(x, code, w) if side == "ours" else quantize(x, code, w)
                times[side] = time.process_time() - start
                if side == "ours":
                    mine = out
                else:
                    reference = out
            if not np.array_equal(mine, reference):
                raise SystemExit(f"encode_k's bytes differ from ggml_quantize_chunk's for {name}")
            if with_matrix and reference.tobytes() != stored[name].data:
                unlike_stored.append(name)
            theirs_s[code] = theirs_s.get(code, 0.0) + times["theirs"]
            ours_s[code] = ours_s.get(code, 0.0) + times["ours"]
            counted[code] = counted.get(code, 0) + x.size
        label = "with the matrix" if with_matrix else "without a matrix"
        for code in sorted(counted):
            print(f"  {label}, {K_TYPES[code]} ({counted[code] / 1e6:.0f} Mweights): llama.cpp "
                  f"{theirs_s[code]:.2f} s, resumerge {ours_s[code]:.2f} s, ratio {ours_s[code] / theirs_s[code]:.2f}")
        theirs_all, ours_all = sum(theirs_s.values()), sum(ours_s.values())
        print(f"  {label}, all {len(chosen)} tensors: llama.cpp {theirs_all:.1f} CPU s, resumerge {ours_all:.1f} "
              f"CPU s, ratio {ours_all / theirs_all:.2f} (issue 84: <= 1.5); bytes equal"
              + (f"; {len(unlike_stored)} unlike llama_model_quantize's file: {', '.join(unlike_stored[:4])}"
                 if unlike_stored else ""), flush=True)


def encoding(work: Path, env: dict[str, str]) -> None:
    """:func:`encoding_child` in its own niced process on one thread, with the routes' numba cache."""
    peer = work / "peer"
    paths = [peer / "f16" / "model.gguf", peer / "q4_k_m.gguf", peer / "imatrix.gguf"]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"error: the encoding comparison needs the peer route's files, missing: {', '.join(missing)} "
              "(run the bench without --encoding-only first)", file=sys.stderr)
        raise SystemExit(2)
    print(f"encoding, issue 84's figure: the peer's F16 tensors as llama-quantize's Q4_K_M types, one thread each, "
          f"CPU s (time.process_time); load {os.getloadavg()[0]:.1f}", flush=True)
    done = subprocess.run(["nice", "-n", "19", sys.executable, __file__, "--encoding-child", *map(str, paths)],
                          env={**env, **_ONE_THREAD}, cwd=ROOT, check=False, text=True, stdout=sys.stdout,
                          stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise SystemExit(f"the encoding comparison failed:\n{done.stderr[-3000:]}")
    print(f"  (load {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--encoding-child":
        encoding_child(*map(Path, sys.argv[2:]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench/work/kquant-route")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-memory", default="4GB")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                        help="the peer's matrix pass's and quantizer's threads (llama-imatrix's and "
                             "llama-quantize's default: every hardware thread)")
    parser.add_argument("--peer-batch", type=int, default=2048,
                        help="the peer's matrix pass: texts decoded together up to this many tokens, each its own "
                             "sequence (llama-imatrix's default n_batch 2048); 0: one text a decode")
    parser.add_argument("--numba", choices=("cold", "warm", "both"), default="both",
                        help="resumerge's run with an empty numba cache, with one filled by a run before, or both")
    parser.add_argument("--encoding", action=argparse.BooleanOptionalAction, default=True,
                        help="after the routes, the encoding's CPU s against llama.cpp's quantizer's")
    parser.add_argument("--encoding-only", action="store_true",
                        help="only the encoding comparison, on the files the routes left under --work")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "numba-cache"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", NUMBA_CACHE_DIR=str(cache))
    print(f"{numba_line()}; {os.cpu_count()} hardware threads", flush=True)
    if args.encoding_only:
        encoding(work, env)
        return
    config, texts = make_inputs(work, args.layers, args.texts)
    size = sum(f.stat().st_size for f in (config.parent / f"models-{args.layers}" / "a").glob("*.safetensors"))
    print(f"two models of {size / 1e9:.2f} GB, {args.texts} texts; load {os.getloadavg()}", flush=True)

    runs: dict[str, Ours] = {}
    shutil.rmtree(cache, ignore_errors=True)
    if args.numba == "warm":
        print("resumerge, an untimed run to fill the numba cache:", flush=True)
        run_ours("warm-up", work / "ours-warmup", config, texts, args, env, timed=False)
        shutil.rmtree(work / "ours-warmup")
        print(f"  {cache_line(cache)}", flush=True)
    for kind in (("cold", "warm") if args.numba == "both" else (args.numba,)):
        print(f"resumerge, numba cache {kind} ({cache}):", flush=True)
        runs[kind] = run_ours("run q4_k_m --imatrix-texts", work / f"ours-{kind}", config, texts, args, env)
        print(f"  {cache_line(cache)} after it", flush=True)
    if len(runs) == 2:
        same = digest(runs["cold"].folder / "out" / "model.gguf") == digest(runs["warm"].folder / "out" / "model.gguf")
        print(f"  cold and warm GGUFs {'identical' if same else 'DIFFER'}", flush=True)
    first = next(iter(runs.values()))
    (matrix,) = (first.folder / "state" / "imatrix").glob("*.gguf")

    peer = work / "peer"
    shutil.rmtree(peer, ignore_errors=True)
    peer.mkdir()
    print("peer:", flush=True)
    with DiskPeak([peer]) as peer_disk:
        merged = measured("mergekit-yaml", ["mergekit-yaml", str(config), str(peer / "float")], env)
        f16 = peer / "f16.yml"
        f16.write_text(f"merge_method: linear\ndtype: float16\nmodels:\n  - model: {peer / 'float'}\n"
                       "    parameters:\n      weight: 1.0\n")
        converted = measured("F16 GGUF (resumerge: convert_hf_to_gguf.py not here)",
                             [sys.executable, "-m", "resumerge", "run", str(f16), str(peer / "f16"), "--state-dir",
                              str(peer / "state"), "--out-type", "gguf", "--gguf-type", "f16"], env)
        pass_step = measured(f"imatrix pass (llama.cpp's forward, the oracle's Python collector), {args.peer_threads} "
                             f"threads, batches of {args.peer_batch or 'one text'} tokens",
                             [sys.executable, "-c", IMATRIX_PASS, str(peer / "f16" / "model.gguf"), str(texts),
                              str(peer / "imatrix.gguf"), str(args.peer_threads), str(args.peer_batch)], env)
        load, tokenized, forward, callback, write, tokens = map(float, pass_step.stdout.split("parts")[1].split()[:6])
        started = pass_step.wall - load - tokenized - forward - write
        print(f"    of it: library load {load:.1f} s, tokenizing {tokenized:.2f} s, forward {forward:.1f} s of which "
              f"{callback:.1f} s in the Python callback, writing {write:.2f} s, the rest {started:.1f} s (Python's "
              f"start and imports); {tokens:.0f} tokens. llama-imatrix runs its collector as C++: this pass is "
              f"slower than it by up to the callback's and the start's {callback + started:.1f} s", flush=True)
        quantized = measured(f"llama_model_quantize Q4_K_M with the peer's matrix, {args.peer_threads} threads",
                             [sys.executable, "-c", QUANTIZE, str(peer / "f16" / "model.gguf"),
                              str(peer / "q4_k_m.gguf"), str(peer / "imatrix.gguf"), str(args.peer_threads), "15"],
                             env)
    peer_final = (peer / "q4_k_m.gguf").stat().st_size
    peer_extra = peer_disk.peak - peer_final
    steps = [merged, converted, pass_step, quantized]
    without = [merged, converted, quantized]
    p_peak = max(s.peak for s in steps)
    totals = {"with its matrix pass": (sum(s.wall for s in steps), sum(s.cpu for s in steps)),
              "without it": (sum(s.wall for s in without), sum(s.cpu for s in without))}
    for label, (p_wall, p_cpu) in totals.items():
        print(f"  total {label}: wall {p_wall:.1f} s, CPU {p_cpu:.1f} s", flush=True)
    print(f"  peak RSS {p_peak / 2**30:.2f} GiB, GGUF {peer_final / 1e9:.3f} GB, extra disk at its peak "
          f"{peer_extra / 1e9:.3f} GB", flush=True)
    compare_matrices(matrix, peer / "imatrix.gguf")
    compare_ggufs(first.folder / "out" / "model.gguf", peer / "q4_k_m.gguf")
    for kind, ours in runs.items():
        for label, (p_wall, p_cpu) in totals.items():
            print(f"resumerge ({kind} numba cache) / peer ({label}): wall {ours.step.wall / p_wall:.2f}x, "
                  f"CPU {ours.step.cpu / p_cpu:.2f}x", flush=True)
        print(f"  extra disk {ours.extra / 1e9:.3f} vs {peer_extra / 1e9:.3f} GB", flush=True)
    print(f"load {os.getloadavg()}", flush=True)
    if args.encoding:
        encoding(work, env)


if __name__ == "__main__":
    main()
