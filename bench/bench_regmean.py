"""``measure`` and ``regmean`` beside ``task_arithmetic`` on the real SmolLM2-135M: wall time, peak RSS, and
``check``'s NLL and KL of each merge.

Usage::

    python bench/bench_regmean.py [--work DIR] [--texts FILE]

Makes two synthetic fine-tunes of SmolLM2-135M-Instruct (float32; tests/realmodel.py's ``smollm2_folder``): each
linear weight of every layer nudged by seeded noise of 1 % of its own spread, the two differently. Then, each in a
fresh process measured by bench_vs_mergekit's launcher (wall time, the process's own peak RSS): ``measure`` of the
two fine-tunes over the built-in texts (and RegMean++'s merged pass), the ``regmean`` and ``regmean_plus`` merges
of them on those Grams, and the ``task_arithmetic`` merge of them onto the base (weight 0.5 each, the same average
of the task vectors a plain mean gives). Each merge is then checked (``resumerge.check``) against the base and the
two fine-tunes. Prints markdown rows for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench_vs_mergekit import run_measured  # noqa: E402

from resumerge.memory.sizes import format_size  # noqa: E402


def fine_tune(base: Path, out: Path, seed: int) -> Path:
    """``base`` with every decoder layer's 2-D weight nudged by 1 % of its standard deviation (seed ``seed``)."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    shutil.copytree(base, out, dirs_exist_ok=True)
    state = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if ".layers." in name and t.dim() == 2:
            state[name] = t + 0.01 * float(t.std()) * torch.randn(t.shape, generator=g)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench-work/regmean")
    parser.add_argument("--texts", default=None)
    args = parser.parse_args()
    from realmodel import smollm2_folder

    from resumerge import api

    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    base = smollm2_folder()
    a, b = fine_tune(base, work / "ft-a", 1), fine_tune(base, work / "ft-b", 2)
    grams = work / "grams"
    shutil.rmtree(grams, ignore_errors=True)
    plus = work / "grams-plus"
    shutil.rmtree(plus, ignore_errors=True)
    configs = {
        "regmean": f"merge_method: regmean\nmodels:\n  - model: {a}\n  - model: {b}\nparameters: {{grams: {grams}}}\n",
        "regmean_plus": (f"merge_method: regmean_plus\nmodels:\n  - model: {a}\n  - model: {b}\n"
                         f"parameters: {{grams: {plus}}}\n"),
        "task_arithmetic": (f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n"
                            f"  - model: {a}\n    parameters: {{weight: 0.5}}\n"
                            f"  - model: {b}\n    parameters: {{weight: 0.5}}\n"),
    }
    for name, text in configs.items():
        (work / f"{name}.yml").write_text(text)
    rows = []
    texts = ["--texts", args.texts] if args.texts else []
    resumerge = [sys.executable, "-m", "resumerge"]
    measured = run_measured([*resumerge, "measure", str(work / "regmean.yml"), str(grams), "-q", *texts])
    size = sum(p.stat().st_size for p in grams.rglob("*.safetensors"))
    rows.append(f"| measure (2 models, {format_size(size)} of Grams) | {measured.wall:.1f} s | "
                f"{format_size(measured.peak_rss)} | | |")
    measured = run_measured([*resumerge, "measure", str(work / "regmean_plus.yml"), str(plus), "-q", *texts])
    rows.append(f"| measure, RegMean++'s merged pass | {measured.wall:.1f} s | {format_size(measured.peak_rss)} | | |")
    for name in configs:
        out = work / f"out-{name}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / "state", ignore_errors=True)
        done = run_measured([*resumerge, "run", str(work / f"{name}.yml"), str(out), "--state-dir",
                             str(work / "state"), "-q"])
        report = api.check(out, base=base, parents=[a, b], state_dir=work / "state")
        doc = report.to_json()
        nll = doc["models"][0]["nll"]
        kls = ", ".join(f"{m['kl']:.2e}" for m in doc["models"][1:] if m.get("kl") is not None)
        rows.append(f"| {name} | {done.wall:.1f} s | {format_size(done.peak_rss)} | {nll:.4f} | {kls} |")
        base_nll = doc["models"][1]["nll"]
    print("| step | wall | peak RSS | merge NLL | KL(model ‖ merge): base, ft-a, ft-b |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row)
    print(json.dumps({"base_nll": base_nll}))


if __name__ == "__main__":
    main()
