"""The SVD merge methods (``tsv``, ``iso_c``, ``iso_cts``) and ``regmean``/``regmean_plus`` beside
``task_arithmetic``: wall time, peak RSS and ``plan``'s estimate of both.

Usage::

    python bench/bench_svd_methods.py [--size 300MB] [--work DIR]
        [--methods tsv,iso_c,iso_cts,task_arithmetic,regmean,regmean_plus] [-j N]

Generates (once per size, kept in ``--work``) three Llama-style float32 models of about ``--size`` each with the
generator of ``bench_vs_mergekit.py``, and merges the second and third onto the first with each method, each run in
a fresh process measured by that bench's launcher (wall time, the process's own peak RSS). An SVD's cost follows
the matrix's shape, not its values, so unrelated random models time like fine-tunes. ``regmean`` and
``regmean_plus`` merge the second and third on their Grams, measured first (``resumerge measure`` over the built-in
texts, kept in ``--work`` beside the models; not timed here): their cost is the n x n solves and the Grams read.
Prints markdown rows for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_vs_mergekit import make_inputs, run_measured  # noqa: E402

from resumerge.machine.memory.sizes import format_size, parse_size  # noqa: E402

METHODS = ("task_arithmetic", "tsv", "iso_c", "iso_cts", "regmean", "regmean_plus")
GRAM_METHODS = ("regmean", "regmean_plus")


def config_text(method: str, base: Path, others: list[Path], grams: Path | None = None) -> str:
    """The merge of ``others`` onto ``base`` with ``method`` (task arithmetic: weight 0.5 each; the SVD methods at
    their defaults; regmean's of ``others`` alone on the Grams in ``grams``)."""
    if method in GRAM_METHODS:
        models = "".join(f"\n  - model: {p}" for p in others)
        return f"merge_method: {method}\ndtype: float32\nparameters: {{grams: {grams}}}\nmodels:{models}\n"
    weight = "\n    parameters: {weight: 0.5}" if method == "task_arithmetic" else ""
    models = "".join(f"\n  - model: {p}{weight}" for p in others)
    return f"merge_method: {method}\nbase_model: {base}\ndtype: float32\nmodels:{models}\n"


def planned(argv: list[str]) -> tuple[float | None, float | None, int]:
    """``plan --json``'s (seconds, compute seconds, peak bytes) for a ``run`` command line, and how long it took."""
    done = subprocess.run([*argv, "--json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"plan failed:\n{done.stderr[-3000:]}")
    doc = json.loads(done.stdout)
    return doc["time"].get("seconds"), doc["time"].get("compute_seconds"), int(doc["memory"]["peak_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="300MB")
    parser.add_argument("--work", default="bench-work")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("-j", "--num-threads", type=int, default=None)
    args = parser.parse_args()
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    (base, *others), exact = make_inputs(work, parse_size(args.size, option="--size"))
    threads = [] if args.num_threads is None else ["-j", str(args.num_threads)]
    rows = []
    for method in args.methods.split(","):
        config = work / f"svd-{method}.yml"
        grams = work / f"grams-{exact}-{method}"
        config.write_text(config_text(method, base, others, grams))
        if method in GRAM_METHODS and not (grams / "measure.json").is_file():
            print(f"measuring {grams} ...", flush=True)
            shutil.rmtree(grams, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "resumerge", "measure", str(config), str(grams), "-q"], check=True)
        out, state = work / f"out-{method}", work / f"state-{method}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
        common = [str(config), str(out), "--state-dir", str(state), *threads]
        seconds, compute, peak = planned([sys.executable, "-m", "resumerge", "plan", *common])
        print(f"{method} ...", flush=True)
        m = run_measured([sys.executable, "-m", "resumerge", "run", *common, "--quiet"])
        estimate = "?" if seconds is None else f"{seconds:.0f} s (compute {compute or 0:.0f} s)"
        rows.append(f"| {method} | {m.wall:.1f} s | {m.cpu:.1f} s | {format_size(m.peak_rss)} | {estimate} | "
                    f"{format_size(peak)} |")
        print(rows[-1], flush=True)
    print(f"\n3 x {format_size(exact)} float32 models (base + 2), {args.size}:\n")
    print("| method | wall | CPU | peak RSS | plan's time | plan's peak |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\ncommand: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
