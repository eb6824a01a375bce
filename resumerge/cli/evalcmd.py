"""``resumerge eval TARGET --tasks NAMES``: its options, its one :func:`resumerge.api.evaluate` call, and its output
(lm-eval's results table, or with ``--json`` lm-eval's results object)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from resumerge.cli import flags

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.run import EvalStep


# The command's line in ``resumerge --help`` and the opening of its own ``--help``.
HELP = "lm-evaluation-harness tasks on a model, one decoder layer at a time within the memory budget"
DESCRIPTION = ("Runs lm-evaluation-harness (lm-eval) tasks on TARGET: lm-eval builds the requests, the few-shot "
               "prompts and chat templates and computes the metrics; resumerge scores every request of a task "
               "set in one pass, one decoder layer at a time (each layer read once), journaled under the state "
               "dir. Prints lm-eval's results table (--json: its results object). Needs the eval extra "
               "(pip install -c constraints.txt -e '.[eval]' in the clone). Exit 2 on bad input (an unknown "
               "task, a dataset not available offline, a generation kwarg it does not honour) before any "
               "weight is read, 3 when interrupted (run it again: it resumes at the layer reached, with the "
               "same results), 4 when the "
               "same evaluation is under way in another process (named). The flags it shares with lm-eval take "
               "lm-eval's spellings too (--include_path, --num_fewshot, -t, -o, ...); resumerge lm-eval is "
               "lm-eval's whole command line.")


def add_arguments(evaluate: argparse.ArgumentParser) -> None:
    """TARGET and its --tasks, lm-eval's options (under lm-eval's spellings too), the pass's flags, a merge
    config TARGET's options and the output's form."""
    evaluate.add_argument("target", metavar="TARGET", help=f"the model: {flags.PASS_MODEL}; or a merge config (.yml): "
                          "the merge it describes, each layer's tensors merged in memory by run's own method code, "
                          "never written")
    evaluate.add_argument("--tasks", "-t", required=True, metavar="NAMES",
                          help="lm-eval task, group or tag names, comma-separated (or task YAML paths); and "
                               "check's figures as tasks: nll:FILE (NLL per token of FILE's texts, one a line) and "
                               "kl:PARENT:FILE (KL from the model PARENT on them), reported as nll,none and kl,none")
    evaluate.add_argument("--include-path", "--include_path", metavar="DIR",
                          help="a folder of lm-eval task YAMLs, beside its own")
    evaluate.add_argument("--limit", "-L", type=float, metavar="N",
                          help="at most N documents per task (a number below 1: that share of each task)")
    evaluate.add_argument("--num-fewshot", "--num_fewshot", "-f", type=int, metavar="K",
                          help="few-shot examples in each prompt [default: each task's own]")
    evaluate.add_argument("--apply-chat-template", "--apply_chat_template", nargs="?", const=True, default=False,
                          metavar="NAME",
                          help="put each prompt through the model's chat template (NAME: one of several)")
    evaluate.add_argument("--log-samples", "--log_samples", "-s", action="store_true",
                          help="with --output-path: write each task's samples (the per-request log-likelihoods) "
                               "as lm-eval's --log_samples does")
    evaluate.add_argument("--output-path", "--output_path", "-o", metavar="DIR",
                          help="write lm-eval's results file (and the samples) under DIR as lm-eval's --output_path "
                               "does")
    evaluate.add_argument("--seed", metavar="SEEDS",
                          help="lm-eval's seeds: python's random, numpy, torch, few-shot, comma-separated, or one "
                               "for all four (None leaves one unset); a sampled generation task (do_sample) draws "
                               "from the torch one, the same answers on every run and resume [default: "
                               "0,1234,1234,1234]")
    flags.add(evaluate, *flags.PASS_FLAGS)
    evaluate.add_argument("--random-seed", type=int, default=0, metavar="N",
                          help="a merge config TARGET: seed of randomised methods, as for run [default: 0]")
    evaluate.add_argument("--allow-crimes", action="store_true",
                          help="a merge config TARGET: merge models of different architectures, as for run")
    evaluate.add_argument("--unsafe-truncate-embeddings", action="store_true",
                          help="a merge config TARGET: merge vocabularies of different sizes, as for run")
    flags.add_executor(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print lm-eval's results object as JSON")
    evaluate.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (one line per layer)")


def run_eval_command(args: argparse.Namespace) -> int:
    """One API call, then the table (or the JSON)."""
    from resumerge.api import evaluate

    def progress(step: EvalStep) -> None:
        if step.plan is not None:  # a generation's estimate, before its first step
            print(f"eval: {step.target}: {step.plan}", file=sys.stderr, flush=True)
            return
        where = "the head" if step.layer is None else f"layer {step.layer + 1}/{step.layers}"
        if step.step is not None:
            where = f"token step {step.step + 1}/{step.steps}: {where}"
        print(f"eval: {step.target}: {','.join(step.tasks)}: {step.kind} pass of {step.requests} request(s): "
              f"{where}", file=sys.stderr, flush=True)

    report = evaluate(progress=None if args.quiet else progress, **flags.api_options(args, evaluate))
    if report.proof is not None and not args.quiet:  # stderr: --json's stdout is lm-eval's object alone
        print(f"eval: inputs: {report.proof}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    else:
        print(report.table())
        for path in report.written:
            print(f"wrote {path}")
    return 0
