"""``--gguf-target-size`` against llama-quantize's mixes at the same size, on the real SmolLM2-135M-Instruct: the
KL from the float32 merge on held-out texts of the file whose types the importance pass's measured costs chose,
against the Q4_K_M / Q3_K_M file with the same importance matrix, each within the other's bytes.

Usage::

    python bench/bench_gguf_target.py [--work DIR] [--mixes q4_k_m,q3_k_m] [--nudge 0.25]

The merge is bench_gguf_kl's: a synthetic fine-tune of SmolLM2-135M-Instruct (every decoder layer's linear weights
nudged by ``--nudge`` of their spread, 1 % by default) merged with the base (``linear``, 0.5 each), once as float32
safetensors. Per mix:
``--gguf-type MIX --imatrix-texts`` (the matrix computed on the merge from the calibration texts: the train files of
``tests/evolve/data``), then ``--gguf-type MIX --imatrix-texts --gguf-target-size`` the first file's size in bytes
(the same matrix; the mix's types for the embeddings and the head, the decoder matrices' chosen). Each file is
measured twice, on texts none of which calibrated it: by llama.cpp's own forward (llama-cpp-py-sync,
:mod:`llamacpp_logits`) on the file and on an F32 GGUF of the same merge, over check's built-in texts and the
evolve texts' held-out halves (``*_heldout.txt``, a text a line), and by resumerge's check pass
(``resumerge.api.check``, float32 merge as parent) over check's built-in texts: KL(float32 merge ‖ GGUF) and top-1
agreement each.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench_gguf_kl import CALIBRATION, float_merge  # noqa: E402
from bench_regmean import fine_tune  # noqa: E402
from llamacpp_logits import kl_by_llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench-work/gguf-target")
    parser.add_argument("--mixes", default="q4_k_m,q3_k_m")
    # SmolLM2's fixture is a Q4_1 GGUF: a 1 % nudge leaves the merge near Q4_1's grid (a type on that grid then
    # costs all but nothing); 0.25 takes it off, as bench_gguf_kl does for Gemma's Q4_K_M fixture.
    parser.add_argument("--nudge", type=float, default=0.01)
    args = parser.parse_args()
    from realmodel import smollm2_folder

    from resumerge import api

    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    resumerge = [sys.executable, "-m", "resumerge"]
    base = smollm2_folder()
    tuned = fine_tune(base, work / "ft", 1, args.nudge)
    config, state, floated, texts = float_merge(work, base, tuned)

    def written(name: str, *flags: str) -> Path:
        out = work / name
        if not (out / "model.gguf").is_file():
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run([*resumerge, "run", str(config), str(out), "--state-dir", str(state), "-q", "--out-type",
                            "gguf", *flags], check=True)
        return out / "model.gguf"

    from resumerge.forward.text.texts import load_tokenizer, sequences

    tokenizer = load_tokenizer([floated])
    lines = work / "heldout.txt"  # the evolve texts' held-out halves, a text a line
    lines.write_text("".join((CALIBRATION / f"{domain}_heldout.txt").read_text() for domain in ("weather", "recipes")))
    held_out = sequences(tokenizer, None) + sequences(tokenizer, lines)  # check's built-in texts (chat), then those
    reference = written("out-f32", "--gguf-type", "f32")

    def measured(model: Path) -> tuple[dict[str, float], dict[str, float]]:
        report = api.check(model, parents=[floated], settings=api.Settings(state_dir=state)).to_json()
        return kl_by_llama(reference, model, held_out), report["models"][1]

    def cells(found: dict[str, float]) -> str:
        return f"{found['kl']:.4f} | {found['top1']:.1%}"

    rows = []
    for mix in args.mixes.split(","):
        model = written(f"out-{mix}", "--imatrix-texts", str(texts), "--gguf-type", mix)
        size = model.stat().st_size
        chosen = written(f"out-{mix}-target", "--imatrix-texts", str(texts), "--gguf-type", mix,
                         "--gguf-target-size", str(size))
        (mix_llama, mix_check), (target_llama, target_check) = measured(model), measured(chosen)
        rows.append(f"| {mix} | {size:,} | {chosen.stat().st_size:,} | {cells(mix_llama)} | {cells(target_llama)} | "
                    f"{target_llama['kl'] / mix_llama['kl'] - 1:+.1%} | {cells(mix_check)} | {cells(target_check)} | "
                    f"{target_check['kl'] / mix_check['kl'] - 1:+.1%} |")
        print(rows[-1], flush=True)
    print("| mix (same matrix) | mix file, bytes | target file, bytes | llama.cpp: KL mix | top-1 mix | KL target | "
          "top-1 target | KL change | check: KL mix | top-1 mix | KL target | top-1 target | KL change |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
