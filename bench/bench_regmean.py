"""``measure`` and ``regmean`` (and the data-free SVD methods) beside ``task_arithmetic`` on the real
SmolLM2-135M: wall time, peak RSS, and ``check``'s NLL and KL of each merge.

Usage::

    python bench/bench_regmean.py [--work DIR] [--texts FILE] [--methods regmean,tsv,...]

Makes two synthetic fine-tunes of SmolLM2-135M-Instruct (float32; tests/realmodel.py's ``smollm2_folder``): each
linear weight of every layer nudged by seeded noise of 1 % of its own spread, the two differently. Then, each in a
fresh process measured by bench_vs_mergekit's launcher (wall time, the process's own peak RSS): ``measure`` of the
two fine-tunes over the built-in texts (and RegMean++'s merged pass), the ``regmean`` and ``regmean_plus`` merges
of them on those Grams, and the ``task_arithmetic`` merge of them onto the base (weight 0.5 each, the same average
of the task vectors a plain mean gives). Each merge is then checked (``resumerge.analyses.check``) against the base and
the two fine-tunes. ``tsv``, ``iso_c`` and ``iso_cts`` merge the same two onto the base at ``scaling`` 0.5 (the
task arithmetic row's weights: on the summed task vectors, 0.5 is their mean). ``--methods`` picks the merges
(default: all; ``measure`` runs only for the regmean ones). ``--lora`` adds ``core_space`` rows: two rank-16 PEFT
adapters of the base (q, v and down projections; factors seeded, scaled so each changes the model about as a
fine-tune above does) merged in their core space with ``inner`` task_arithmetic, ties and tsv, beside the
``task_arithmetic`` merge of the two adapted models (``BASE+ADAPTER`` parents, weight 0.5). Prints markdown rows
for bench/RESULTS.md.
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

from resumerge.machine.memory.sizes import format_size  # noqa: E402


def fine_tune(base: Path, out: Path, seed: int, scale: float = 0.01) -> Path:
    """``base`` with every decoder layer's 2-D weight nudged by ``scale`` (1 %) of its standard deviation (seed
    ``seed``)."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    shutil.copytree(base, out, dirs_exist_ok=True)
    state = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if ".layers." in name and t.dim() == 2:
            state[name] = t + scale * float(t.std()) * torch.randn(t.shape, generator=g)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def lora_adapter(base: Path, out: Path, seed: int) -> Path:
    """A rank-16 PEFT adapter of ``base`` (q, v, down projections) whose B factors are scaled to 1 % of the test
    generator's, so that the adapted model moves about as much as a 1 % fine-tune."""
    import torch
    from lora.gen import make_adapter
    from safetensors.torch import load_file, save_file

    if (out / "adapter_model.safetensors").is_file():
        return out
    make_adapter(base, out, r=16, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=seed)
    path = out / "adapter_model.safetensors"
    factors = load_file(str(path))
    save_file({k: (v * 0.01 if "lora_B" in k else v).to(torch.float32) for k, v in factors.items()}, str(path),
              metadata={"format": "pt"})
    return out


def lora_configs(base: Path, work: Path) -> tuple[dict[str, str], Path, Path]:
    """The ``core_space`` configs (three inner methods) and the task arithmetic of the adapted models."""
    a, b = lora_adapter(base, work / "lora-a", 1), lora_adapter(base, work / "lora-b", 2)
    parents = f"  - model: {base}+{a}\n  - model: {base}+{b}\n"
    configs = {f"core_space ({inner})": (f"merge_method: core_space\nbase_model: {base}\nmodels:\n{parents}"
                                         f"parameters: {{inner: {inner}, scaling: 0.5{extra}}}\n")
               for inner, extra in (("task_arithmetic", ""), ("ties", ", density: 0.5"), ("tsv", ""))}
    configs["task_arithmetic (adapters applied)"] = (
        f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n"
        f"  - model: {base}+{a}\n    parameters: {{weight: 0.5}}\n"
        f"  - model: {base}+{b}\n    parameters: {{weight: 0.5}}\n")
    return configs, a, b


def applied(base: Path, adapter: Path, work: Path, resumerge: list[str]) -> Path:
    """``base`` with ``adapter`` applied, as a model folder (a passthrough merge of ``BASE+ADAPTER``)."""
    import subprocess

    out = work / f"applied-{adapter.name}"
    if not (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").is_file():
        config = work / f"apply-{adapter.name}.yml"
        config.write_text(f"merge_method: passthrough\nmodels:\n  - model: {base}+{adapter}\ndtype: float32\n")
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([*resumerge, "run", str(config), str(out), "--state-dir", str(work / "state-apply"), "-q"],
                       check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="bench-work/regmean")
    parser.add_argument("--texts", default=None)
    parser.add_argument("--methods", default=None, help="comma list of merges to run (default: all)")
    parser.add_argument("--lora", action="store_true", help="add core_space rows on two adapters of the base")
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
    for method in ("tsv", "iso_c", "iso_cts"):
        configs[method] = (f"merge_method: {method}\nbase_model: {base}\nparameters: {{scaling: 0.5}}\nmodels:\n"
                           f"  - model: {a}\n  - model: {b}\n")
    if args.methods:
        configs = {k: v for k, v in configs.items() if k in args.methods.split(",")}
    checked_against = dict.fromkeys(configs, (a, b))
    if args.lora:
        extra, la, lb = lora_configs(base, work)
        configs |= extra
        checked_against |= dict.fromkeys(extra, (None, None))
    files = {name: work / f"{name.split()[0]}-{i}.yml" for i, name in enumerate(configs)}
    for name, text in configs.items():
        files[name].write_text(text)
    rows = []
    texts = ["--texts", args.texts] if args.texts else []
    resumerge = [sys.executable, "-m", "resumerge"]
    if "regmean" in configs:
        measured = run_measured([*resumerge, "measure", str(files["regmean"]), str(grams), "-q", *texts])
        size = sum(p.stat().st_size for p in grams.rglob("*.safetensors"))
        rows.append(f"| measure (2 models, {format_size(size)} of Grams) | {measured.wall:.1f} s | "
                    f"{format_size(measured.peak_rss)} | | |")
    if "regmean_plus" in configs:
        measured = run_measured([*resumerge, "measure", str(files["regmean_plus"]), str(plus), "-q", *texts])
        rows.append(f"| measure, RegMean++'s merged pass | {measured.wall:.1f} s | "
                    f"{format_size(measured.peak_rss)} | | |")
    for index, name in enumerate(configs):
        out = work / f"out-{index}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / "state", ignore_errors=True)
        done = run_measured([*resumerge, "run", str(files[name]), str(out), "--state-dir",
                             str(work / "state"), "-q"])
        parents = [p for p in checked_against[name] if p is not None]
        if not parents:  # the adapted models, as folders the check can read: the adapter applied by a merge
            parents = [applied(base, adapter, work, resumerge) for adapter in (la, lb)]
        report = api.check(out, base=base, parents=parents, state_dir=work / "state")
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
