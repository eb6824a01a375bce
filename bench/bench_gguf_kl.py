"""Each GGUF file type's KL from the float32 merge, on the real SmolLM2-135M-Instruct (or Gemma-3-270M): the
figures a GGUF output's model card quotes (``resumerge.merge.plan.gguftypes.KL_BY_TYPE``).

Usage::

    python bench/bench_gguf_kl.py [--work DIR] [--types q4_0,q8_0,...] [--model smollm2|gemma3]

Makes a synthetic fine-tune of SmolLM2-135M-Instruct (``--model gemma3``: Gemma-3-270M, its Q4_K_M GGUF fixture
written as float32 safetensors by resumerge itself) (float32; bench_regmean's ``fine_tune``: every decoder
layer's linear weights nudged by 1 % of their spread) and merges it with the base (``linear``, weight 0.5 each),
once as float32 safetensors and once per ``--gguf-type``; a K-quant or IQ4 mix twice, without an importance matrix
and with the one ``--imatrix-texts`` computes (Q2_K_S only with it) on the merge from the calibration texts (the
train files of ``tests/evolve/data``: weather forecasts and recipes, none of check's texts; computed once, the runs
share it). Each
GGUF output is then checked by resumerge's own check pass (``resumerge.api.check``) with the float32 merge as its
parent, over check's built-in texts: the parent's KL is KL(float32 merge ‖ GGUF output), and its top-1 agreement
the share of positions whose most likely token is the same. Prints markdown rows for bench/RESULTS.md and the
table's Python literal (``resumerge/outputs/gguf/quality.py``'s ``QUALITY``).
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

from bench_regmean import fine_tune  # noqa: E402

TYPES = ("f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
K_MIXES = ("q4_k_m", "q5_k_m", "q6_k", "q3_k_m", "q2_k", "q4_k_s", "q5_k_s", "q3_k_s", "q3_k_l")
# the mixes measured without and with the matrix too (Q2_K_S: only with one, as llama.cpp writes it)
I_MIXES = ("iq4_nl", "iq4_xs", "q2_k_s", "iq3_m", "iq3_s", "iq3_xs", "iq3_xxs")
CALIBRATION = HERE.parent / "tests" / "evolve" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench-work/gguf-kl")
    parser.add_argument("--types", default=",".join(TYPES + K_MIXES + I_MIXES))
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    args = parser.parse_args()
    from realmodel import gemma3_gguf, smollm2_folder

    from resumerge import api

    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    resumerge = [sys.executable, "-m", "resumerge"]
    if args.model == "smollm2":
        base = smollm2_folder()
    else:  # the GGUF's values decoded to float32 safetensors, with its tokenizer, by a passthrough run
        base = work / "gemma3-f32"
        if not (base / "model.safetensors").is_file():
            shutil.rmtree(base, ignore_errors=True)
            (work / "gemma3.yml").write_text(f"merge_method: passthrough\ndtype: float32\nmodels:\n  - model: "
                                             f"{gemma3_gguf()}\n")
            subprocess.run([*resumerge, "run", str(work / "gemma3.yml"), str(base), "--state-dir",
                            str(work / "state-gemma3"), "-q", "--out-shard-size", "10GB"],
                           check=True)  # one file: fine_tune reads model.safetensors
    # Gemma's fixture is itself Q4_K_M: a 1 % nudge leaves the merge on Q4_K's grid, and the Q4_K mixes would give
    # it back all but exactly (KL 0.0000 at q4_k_m, measured); a 25 % nudge takes the merge off the grid.
    tuned = fine_tune(base, work / "ft", 1, 0.01 if args.model == "smollm2" else 0.25)
    # Gemma's vocabulary is one resumerge writes to GGUF only from a GGUF parent: the fixture itself stands in the
    # config for the float32 folder decoded from it (the same values).
    first = base if args.model == "smollm2" else gemma3_gguf()
    config, state, floated, texts = float_merge(work, first, tuned)
    rows, table = [], []
    for kind in args.types.split(","):
        found = []
        from resumerge.merge.plan.gguftypes import MIXES

        for weighted in ((True,) if MIXES[kind].needs_imatrix else (False, True) if kind in K_MIXES + I_MIXES
                         else (False,)):
            out = work / f"out-{kind}{'-imatrix' if weighted else ''}"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run([*resumerge, "run", str(config), str(out), "--state-dir", str(state), "-q", "--out-type",
                            "gguf", "--gguf-type", kind, *(("--imatrix-texts", str(texts)) if weighted else ())],
                           check=True)
            (gguf,) = sorted(out.glob("*.gguf"))
            report = api.check(gguf, parents=[floated], settings=api.Settings(state_dir=state)).to_json()
            merge, parent = report["models"][0], report["models"][1]
            size = gguf.stat().st_size
            rows.append(f"| {kind} | {'yes' if weighted else 'no'} | {size / 1e6:.1f} MB | {parent['kl']:.4f} | "
                        f"{parent['top1']:.1%} | {merge['nll']:.4f} | {parent['nll']:.4f} |")
            found += [f"{parent['kl']:.3g}", f"{parent['top1']:.3f}"]
            print(rows[-1], flush=True)
        table.append(f'    "{kind}": TypeQuality({", ".join(found)}),')
    print("| --gguf-type | importance matrix | file | KL(float32 merge ‖ GGUF) | top-1 agreement | NLL GGUF | "
          "NLL float32 |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("{\n" + "\n".join(table) + "\n}")


def float_merge(work: Path, first: Path, tuned: Path) -> tuple[Path, Path, Path, Path]:
    """The bench's merge under ``work``: the linear config of ``first`` and ``tuned`` (0.5 each, float32), its state
    dir, its float32 safetensors output (made once) and the calibration texts (the evolve train files)."""
    config, texts = linear_config(work, first, tuned)
    state = work / "state"
    floated = work / "float32"
    if not (floated / "model.safetensors").is_file():
        shutil.rmtree(floated, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "resumerge", "run", str(config), str(floated), "--state-dir",
                        str(state), "-q"], check=True)
    return config, state, floated, texts


def linear_config(work: Path, first: Path, tuned: Path) -> tuple[Path, Path]:
    """The bench's merge config under ``work`` (``first`` and ``tuned`` linear, 0.5 each, float32: mergekit reads
    it too) and the calibration texts (the evolve train files, a text a line)."""
    config = work / "linear.yml"
    config.write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {first}\n    parameters: "
                      f"{{weight: 0.5}}\n  - model: {tuned}\n    parameters: {{weight: 0.5}}\n")
    texts = work / "calibration.txt"
    texts.write_text("".join((CALIBRATION / f"{domain}_train.txt").read_text() for domain in ("weather", "recipes")))
    return config, texts


if __name__ == "__main__":
    main()
