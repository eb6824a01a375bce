"""Each GGUF file type's KL from the float32 merge, on the real SmolLM2-135M-Instruct: the figures a GGUF output's
model card quotes (``resumerge.plan.gguftypes.KL_BY_TYPE``).

Usage::

    python bench/bench_gguf_kl.py [--work DIR] [--types q4_0,q8_0,...]

Makes a synthetic fine-tune of SmolLM2-135M-Instruct (float32; bench_regmean's ``fine_tune``: every decoder
layer's linear weights nudged by 1 % of their spread) and merges it with the base (``linear``, weight 0.5 each),
once as float32 safetensors and once per ``--gguf-type``. Each GGUF output is then checked by resumerge's own check
pass (``resumerge.api.check``) with the float32 merge as its parent, over check's built-in texts: the parent's KL
is KL(float32 merge ‖ GGUF output), and its top-1 agreement the share of positions whose most likely token is the
same. Prints markdown rows for bench/RESULTS.md and the table's Python literal.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench-work/gguf-kl")
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    from realmodel import smollm2_folder

    from resumerge import api

    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    base = smollm2_folder()
    tuned = fine_tune(base, work / "ft", 1)
    config = work / "linear.yml"
    config.write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {base}\n    parameters: "
                      f"{{weight: 0.5}}\n  - model: {tuned}\n    parameters: {{weight: 0.5}}\n")
    resumerge = [sys.executable, "-m", "resumerge"]
    state = work / "state"
    floated = work / "float32"
    if not (floated / "model.safetensors").is_file():
        shutil.rmtree(floated, ignore_errors=True)
        subprocess.run([*resumerge, "run", str(config), str(floated), "--state-dir", str(state), "-q"], check=True)
    rows, table = [], []
    for kind in args.types.split(","):
        out = work / f"out-{kind}"
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([*resumerge, "run", str(config), str(out), "--state-dir", str(state), "-q", "--out-type",
                        "gguf", "--gguf-type", kind], check=True)
        (gguf,) = sorted(out.glob("*.gguf"))
        report = api.check(gguf, parents=[floated], state_dir=state).to_json()
        merge, parent = report["models"][0], report["models"][1]
        size = gguf.stat().st_size
        rows.append(f"| {kind} | {size / 1e6:.1f} MB | {parent['kl']:.4f} | {parent['top1']:.1%} | "
                    f"{merge['nll']:.4f} | {parent['nll']:.4f} |")
        table.append(f'    "{kind}": {parent["kl"]:.3g},')
        print(rows[-1], flush=True)
    print("| --gguf-type | file | KL(float32 merge ‖ GGUF) | top-1 agreement | NLL GGUF | NLL float32 |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("{\n" + "\n".join(table) + "\n}")


if __name__ == "__main__":
    main()
