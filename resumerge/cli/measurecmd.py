"""``resumerge measure CONFIG OUT_DIR``: its options, its one :func:`resumerge.api.measure` call, and its summary."""

from __future__ import annotations

import argparse
import sys

from resumerge.cli import flags

# The command's line in ``resumerge --help`` and the opening of its own ``--help``.
HELP = "record the Gram matrices of every linear's inputs, for regmean and regmean_plus merges"
DESCRIPTION = ("Runs every model of CONFIG (its models: and base_model) one decoder layer at a time over "
               "calibration texts and writes, per model and layer, the Gram matrix (mean of x·xᵀ over the "
               "tokens) of each linear's input to OUT_DIR as safetensors, with measure.json recording every "
               "file's sha256. A regmean merge names OUT_DIR as its grams parameter; for a regmean_plus "
               "config each layer is measured on the merged model's earlier layers (RegMean++). Exit 2 on bad "
               "input (before anything is written), 3 when interrupted: run it again and it resumes at the "
               "layer reached; 4 when another process is measuring into OUT_DIR (named). With --plan it says "
               "what the measurement needs here and writes nothing.")


def add_arguments(measure: argparse.ArgumentParser) -> None:
    """CONFIG and OUT_DIR, the texts, the pass's flags, the importance matrix written too and --plan."""
    measure.add_argument("config", metavar="CONFIG", help="the merge config whose models to measure")
    measure.add_argument("out", metavar="OUT_DIR", help="an empty (or this measurement's) folder for the Grams")
    measure.add_argument("--texts", metavar="FILE", help="calibration texts, one per line, no chat template "
                         "(default: check's built-in short chat, code, maths and multilingual texts)")
    flags.add(measure, flags.TRUNCATE_TEXTS, *flags.PASS_FLAGS)
    flags.add_executor(measure)
    measure.add_argument("--imatrix", metavar="FILE", help="also write the Grams as llama.cpp's importance matrix "
                         "(llama-imatrix's GGUF, or its older .dat form where FILE ends in .dat: each linear's sums "
                         "of squared inputs, named as llama.cpp names the weight, a mixture of experts' routed "
                         "experts one row and one count per expert; several models' pooled), for run --imatrix or "
                         "llama-quantize --imatrix; with it a mixture of experts is measured (without, refused)")
    measure.add_argument("--plan", action="store_true", help="check the config, the models and the texts and "
                         "estimate each model's pass (decoder layers, memory at its largest step, the smallest budget "
                         "that fits; the RAM on the host, whatever the --device); write nothing: exit 0 when it fits, "
                         "2 when it will not")
    measure.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")


# The flag that picks the call, not an option of it; and what --plan leaves out: OUT_DIR, and where the layers
# would run (the estimate reads the RAM on the host).
PLAN = frozenset({"plan"})
HOST_ONLY = PLAN | {"out", "device", "max_gpu_memory", "imatrix"}


def run_measure_command(args: argparse.Namespace) -> int:
    """One API call, then a one-line summary (with --plan, the estimate)."""
    from resumerge.api import estimate_measure, measure

    if args.plan:  # the plan is the pass's RAM: read on the host from the headers, wherever the layers will run
        estimate = estimate_measure(**flags.api_options(args, estimate_measure, HOST_ONLY))
        if not args.quiet:
            print("\n".join(estimate.lines()))
        return 0 if estimate.fits else 2

    def progress(line: str) -> None:
        print(f"measuring: {line}", file=sys.stderr, flush=True)

    report = measure(progress=None if args.quiet else progress, **flags.api_options(args, measure, PLAN))
    if not args.quiet:
        state = "already measured" if report.reused else "measured"
        print(f"{state}: {len(report.models)} model(s), {report.tokens} tokens each, {report.files} Gram file(s) "
              f"in {report.out}; name it in a regmean merge: parameters: {{grams: {report.out}}}")
        if report.imatrix is not None:
            print(f"importance matrix: {report.imatrix_entries} weight(s) in {report.imatrix} (llama.cpp's GGUF "
                  "imatrix)")
        if report.reused and report.proof is not None:
            print(f"inputs: {report.proof}")
    return 0
