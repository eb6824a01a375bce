"""A GGUF release of N types in one run (``--gguf-type q8_0,q6_k,...``, issue 95) against N runs of one type each.

Usage::

    python bench/bench_gguf_release.py [--work DIR] [--types q8_0,q6_k,q5_k_m,q4_k_m,iq4_xs] [--layers N]
                                       [--hidden N] [--intermediate N]

Generates two llama bfloat16 models once under ``--work`` (``resumerge.cli.modelgen``: ``--hidden``,
``--intermediate``, ``--layers``, 16 heads, 4 KV heads, SmolLM2's tokenizer and its vocabulary of 49152, untied
head; random normal weights) and a linear 0.5/0.5 config, then times

- ``release``: one ``resumerge run --out-type gguf --gguf-type T1,T2,...`` (one file per type);
- ``singles``: one ``resumerge run --out-type gguf --gguf-type Ti`` per type, one after the other,

each in a fresh OUT and state dir, and prints for each command and each route's total: the wall, the CPU seconds
(user + system of the command, from ``wait4``), the peak RSS, and the bytes the process read by ``read``-family
calls (``rchar`` of ``/proc/PID/io``, sampled every 0.05 s until it exits: resumerge reads its inputs with
``pread``/``readinto``, hashes each local input once, and reads each GGUF unit back once to hash it after its
fsync, so this is twice the inputs plus the output plus the small files; page-cache hits count, a cold disk is not
needed for the figure), and that figure less the GGUF bytes the command wrote (``inputs read``). Then it checks
that each release file is byte-identical to its single run's ``model.gguf`` and prints the ratios. Run it niced on
a shared machine: the load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
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


class Step(NamedTuple):
    """One command's figures (``wrote``: the GGUF bytes it wrote, each read back once to hash it; ``said``: its
    standard output)."""

    label: str
    wall: float
    cpu: float
    peak_rss: int
    read: int
    wrote: int = 0
    said: str = ""

    def line(self) -> str:
        return (f"  {self.label:<34} wall {self.wall:7.1f} s  CPU {self.cpu:7.1f} s  peak {self.peak_rss / 1e9:5.2f} "
                f"GB  read {self.read / 1e9:6.2f} GB  inputs read {(self.read - self.wrote) / 1e9:6.2f} GB")


def measured(label: str, argv: list[str], out: Path) -> Step:
    """Run ``argv`` writing ``out`` (a folder: its GGUF files are what it wrote; or a file) and measure it (exits
    on failure)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-gguf-release-{os.getpid()}.log"
    said = log.with_suffix(".out")
    started = time.perf_counter()
    # files, not pipes: a pipe nobody reads fills and stops the run
    with log.open("w") as err, said.open("w") as told:
        process = subprocess.Popen(argv, env=env, stdout=told, stderr=err)
    read = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                text = Path(f"/proc/{process.pid}/io").read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("rchar:"):
                    read[0] = max(read[0], int(line.split()[1]))
            time.sleep(0.05)

    poller = threading.Thread(target=sample, daemon=True)
    poller.start()
    _, status, usage = os.wait4(process.pid, 0)  # the child's own rusage: reaped here, not by Popen
    wall = time.perf_counter() - started
    done.set()
    poller.join()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{label} failed: {log.read_text()[-2000:]}")
    log.unlink()
    step = Step(label, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, read[0],
                sum(f.stat().st_size for f in out.glob("*.gguf")) if out.is_dir() else out.stat().st_size,
                said.read_text())
    said.unlink()
    print(step.line(), flush=True)
    return step


def make_inputs(work: Path, layers: int, hidden: int, intermediate: int) -> Path:
    """The two models (made once) and the merge config: the K-quant route bench's pair."""
    from bench_kquant_route import linear_pair  # this folder is the script's: on sys.path

    return linear_pair(work, layers, hidden, intermediate)


def total(label: str, steps: list[Step]) -> Step:
    found = Step(label, sum(s.wall for s in steps), sum(s.cpu for s in steps), max(s.peak_rss for s in steps),
                 sum(s.read for s in steps), sum(s.wrote for s in steps))
    print(found.line(), flush=True)
    return found


def main() -> None:
    from bench_kquant_route import digest  # this folder is the script's: on sys.path


    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-gguf-release"))
    parser.add_argument("--types", default="q8_0,q6_k,q5_k_m,q4_k_m,iq4_xs")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    config = make_inputs(args.work, args.layers, args.hidden, args.intermediate)
    kinds = args.types.split(",")
    run = [sys.executable, "-m", "resumerge", "run", str(config)]
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; types {args.types}; "
          f"models {args.layers} layers, hidden {args.hidden}", flush=True)

    def out(name: str) -> tuple[Path, Path]:
        found = args.work / "out" / name
        shutil.rmtree(found, ignore_errors=True)
        shutil.rmtree(found.with_suffix(".state"), ignore_errors=True)
        return found, found.with_suffix(".state")

    print("release (one run):")
    release, state = out("release")
    one = measured(f"run --gguf-type {args.types}", [*run, str(release), "--state-dir", str(state),
                                                     "--out-type", "gguf", "--gguf-type", args.types], release)
    print("singles (one run per type):")
    steps, alone = [], {}
    for kind in kinds:
        single, state = out(kind)
        steps.append(measured(f"run --gguf-type {kind}", [*run, str(single), "--state-dir", str(state),
                                                          "--out-type", "gguf", "--gguf-type", kind], single))
        alone[kind] = digest(single / "model.gguf")
    print("totals:")
    singles = total(f"{len(kinds)} single runs", steps)
    files = {kind: next(release.glob(f"*-{kind.upper()}.gguf")) for kind in kinds}
    same = all(digest(files[kind]) == alone[kind] for kind in kinds)
    print(f"every release file byte-identical to its single run: {same}")
    print(f"release / singles: wall {one.wall / singles.wall:.2f}x, CPU {one.cpu / singles.cpu:.2f}x, "
          f"read {one.read / max(1, singles.read):.2f}x, inputs read "
          f"{(one.read - one.wrote) / max(1, singles.read - singles.wrote):.2f}x; sizes "
          + ", ".join(f"{f.name} {f.stat().st_size / 1e6:.1f} MB" for f in files.values()))
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
