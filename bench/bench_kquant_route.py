"""A merge straight to Q4_K_M with an importance matrix computed on the merge (issue 84), against the peer route.

Usage::

    python bench/bench_kquant_route.py [--work DIR] [--texts N] [--layers N] [--threads N]

Generates two llama bfloat16 models of about 1 GB each once under ``--work`` (``resumerge.cli.modelgen``: hidden
2048, intermediate 5632, ``--layers`` layers, vocabulary 49152, untied head, SmolLM2's tokenizer; random normal
weights), a texts file of ``--texts`` lines, and a linear 0.5/0.5 config, then times each route's commands (wall,
CPU = user + system of the command and its children, peak RSS of its largest process) and samples the disk the
route holds beside its final GGUF every 0.2 s:

- ``resumerge``: one command, ``resumerge run --out-type gguf --gguf-type q4_k_m --imatrix-texts TEXTS`` (the
  matrix computed on the merge never written, then the merge encoded with it; fully durable);
- ``peer``: ``mergekit-yaml`` (the float merge written as bfloat16 safetensors), the merge as an F16 GGUF, then
  llama.cpp's library quantizer (``llama_model_quantize`` of PyPI ``llama-cpp-py-sync``, loaded as the tests load
  it, ``tests/llamacpp_oracle.py``) to Q4_K_M with an importance matrix. llama.cpp's ``convert_hf_to_gguf.py`` is
  not installed here, so the F16 GGUF is written by resumerge (``run --out-type gguf --gguf-type f16`` of the
  float merge); ``llama-imatrix`` cannot run here either (the wheel ships the libraries, not the tools), so the
  quantizer is given the matrix resumerge computed, and the peer's imatrix pass is **not** timed (in its favour).
  The quantizer runs on ``--peer-threads`` threads, every hardware thread by default as llama-quantize's own
  default (until session 46 the bench gave it one, in resumerge's favour).

Prints each command's figures, each route's totals and their ratios. Run it niced on a shared machine: the load
average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

# Forks the command, waits for it and prints its exit code, the peak RSS of its largest process and the CPU
# seconds of it and its children.
_LAUNCHER = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime)\n"
)
# llama.cpp's quantizer through its library, given the importance matrix as llama-quantize gives it.
_QUANTIZE = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from llamacpp_oracle import quantize_model\n"
    "from resumerge.outputs.gguf.imatrix import read_imatrix\n"
    "quantize_model(Path(sys.argv[1]), Path(sys.argv[2]), 15, imatrix=read_imatrix(sys.argv[3]),\n"
    "               nthread=int(sys.argv[4]))\n"
)
LINES = ("the quick brown fox jumps over the lazy dog and runs into the woods where nobody has been for years",
         "three plus four is seven and seven times six is forty two which is the answer to many questions",
         "def add(a, b): return a + b  # the sum of two numbers, written in python for the example",
         "paris is the capital of france, berlin the capital of germany and rome the capital of italy")


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


def measured(label: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """``argv`` run niced through the launcher: (wall s, CPU s, peak RSS bytes); exits with its stderr on failure."""
    start = time.monotonic()
    done = subprocess.run(["nice", "-n", "19", sys.executable, "-c", _LAUNCHER, *argv], capture_output=True,
                          text=True, check=False, cwd=ROOT, env=env)
    wall = time.monotonic() - start
    fields = done.stdout.split()[-3:]
    if len(fields) != 3 or fields[0] != "0":
        raise SystemExit(f"{label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    cpu, peak = float(fields[2]), int(fields[1])
    print(f"  {label}: wall {wall:.1f} s, CPU {cpu:.1f} s, peak RSS {peak / 2**30:.2f} GiB "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return wall, cpu, peak


def make_inputs(work: Path, layers: int, texts: int) -> tuple[Path, Path]:
    """The two models (made once), the texts file and the merge config."""
    import torch
    from realmodel import smollm2_folder

    from resumerge.cli.modelgen import ModelSpec, make_model

    # SmolLM2's byte-level BPE tokenizer (a GGUF vocabulary resumerge builds; modelgen's own is not byte-level)
    vocab_from = smollm2_folder()
    spec = ModelSpec(layers=layers, hidden=2048, intermediate=5632, vocab=49152, heads=16, kv_heads=4,
                     dtype=torch.bfloat16, shard_bytes=450_000_000, tokenizer=False)
    models = []
    for seed, name in enumerate("ab"):
        path = work / f"models-{layers}" / name
        if not (path / "config.json").exists():
            shutil.rmtree(path, ignore_errors=True)
            make_model(path, spec, seed=seed + 1)
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(vocab_from / file, path / file)
        models.append(path)
    text_file = work / "texts.txt"
    text_file.write_text("\n".join(LINES[i % len(LINES)] for i in range(texts)) + "\n")
    config = work / "merge.yml"
    config.write_text("merge_method: linear\ndtype: bfloat16\nmodels:\n" + "".join(
        f"  - model: {m}\n    parameters:\n      weight: 0.5\n" for m in models))
    return config, text_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench/work/kquant-route")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-memory", default="4GB")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                        help="the quantizer's threads (llama-quantize's default: every hardware thread)")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    config, texts = make_inputs(work, args.layers, args.texts)
    size = sum(f.stat().st_size for f in (config.parent / f"models-{args.layers}" / "a").glob("*.safetensors"))
    print(f"two models of {size / 1e9:.2f} GB, {args.texts} texts; load {os.getloadavg()}", flush=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    rm = [sys.executable, "-m", "resumerge"]

    ours = work / "ours"
    shutil.rmtree(ours, ignore_errors=True)
    ours.mkdir()
    print("resumerge:", flush=True)
    with DiskPeak([ours]) as disk:
        wall, cpu, peak = measured("run q4_k_m --imatrix-texts", [*rm, "run", str(config), str(ours / "out"),
                                   "--state-dir", str(ours / "state"), "--out-type", "gguf", "--gguf-type", "q4_k_m",
                                   "--imatrix-texts", str(texts), "--max-memory", args.max_memory], env)
    final = (ours / "out" / "model.gguf").stat().st_size
    print(f"  total: wall {wall:.1f} s, CPU {cpu:.1f} s, peak RSS {peak / 2**30:.2f} GiB, GGUF {final / 1e9:.3f} GB, "
          f"extra disk at its peak {(disk.peak - final) / 1e9:.3f} GB", flush=True)
    (matrix,) = (ours / "state" / "imatrix").glob("*.gguf")

    peer = work / "peer"
    shutil.rmtree(peer, ignore_errors=True)
    peer.mkdir()
    print("peer:", flush=True)
    rows = []
    with DiskPeak([peer]) as peer_disk:
        rows.append(measured("mergekit-yaml", ["mergekit-yaml", str(config), str(peer / "float")], env))
        f16 = peer / "f16.yml"
        f16.write_text(f"merge_method: linear\ndtype: float16\nmodels:\n  - model: {peer / 'float'}\n"
                       "    parameters:\n      weight: 1.0\n")
        rows.append(measured("F16 GGUF (resumerge: convert_hf_to_gguf.py not here)",
                             [*rm, "run", str(f16), str(peer / "f16"), "--state-dir", str(peer / "state"),
                              "--out-type", "gguf", "--gguf-type", "f16"], env))
        rows.append(measured(f"llama_model_quantize Q4_K_M with the matrix, {args.peer_threads} threads",
                             [sys.executable, "-c", _QUANTIZE, str(peer / "f16" / "model.gguf"),
                              str(peer / "q4_k_m.gguf"), str(matrix), str(args.peer_threads)], env))
    peer_final = (peer / "q4_k_m.gguf").stat().st_size
    p_wall, p_cpu, p_peak = sum(r[0] for r in rows), sum(r[1] for r in rows), max(r[2] for r in rows)
    print(f"  total: wall {p_wall:.1f} s, CPU {p_cpu:.1f} s, peak RSS {p_peak / 2**30:.2f} GiB, GGUF "
          f"{peer_final / 1e9:.3f} GB, extra disk at its peak {(peer_disk.peak - peer_final) / 1e9:.3f} GB "
          "(imatrix pass not timed)", flush=True)
    print(f"resumerge / peer: wall {wall / p_wall:.2f}x, CPU {cpu / p_cpu:.2f}x, extra disk "
          f"{(disk.peak - final) / 1e9:.3f} vs {(peer_disk.peak - peer_final) / 1e9:.3f} GB; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
