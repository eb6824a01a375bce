"""``resumerge check MODEL``: its options, its one :func:`resumerge.api.check` call, and its output (the human
table, or ``--json``); the exit code is the verdict's (0 works, 5 no effect, 6 broken)."""

from __future__ import annotations

import argparse
import json

from resumerge.cli import flags

# The command's line in ``resumerge --help`` and the opening of its own ``--help``.
HELP = "does the merge in MODEL work? compare it with its base and parents, layer by layer"
DESCRIPTION = ("A static pass over MODEL's tensors and a forward pass, one decoder layer of one model at a "
               "time, of MODEL, its base and its parents over the same texts: NLL, KL, top-1 agreement, "
               "per-layer drift, and the first layer that departs from every parent. Exit 0 works, 5 no "
               "effect, 6 broken, 2 bad input, 3 interrupted (run it again: it resumes at the layer "
               "reached), 4 a hub file whose bytes are not the hub's (its sha256), or the same check "
               "already under way in another process (named).")


def add_arguments(check: argparse.ArgumentParser) -> None:
    """MODEL, its base and parents (its record names them where they are not given), the texts, the pass's
    flags and the report's form."""
    check.add_argument("model", metavar="MODEL", help=f"the merged model: {flags.PASS_MODEL} (a resumerge output "
                       "names its base and parents in its record; its model card gets the check's section)")
    check.add_argument("--base", metavar="BASE", help="the base model's folder, GGUF file or hf:// repo")
    check.add_argument("--parent", dest="parents", metavar="P", action="append", default=[],
                       help="a parent model's folder, GGUF file or hf:// repo (repeat for each)")
    check.add_argument("--prompts", metavar="FILE", help="texts to run, one per line, no chat template "
                       "(default: built-in short chat, code, maths and multilingual texts)")
    flags.add(check, flags.TRUNCATE_TEXTS, *flags.PASS_FLAGS)
    flags.add_executor(check)
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (in a terminal a bar with "
                       "the layer, the model and the time left; in a log one line per layer), only the report")


def run_check_command(args: argparse.Namespace) -> int:
    """Parse nothing more: one API call, then the report."""
    from resumerge.api import check
    from resumerge.cli.checkprogress import CheckProgress

    progress = CheckProgress(quiet=args.quiet)
    try:
        report = check(progress=progress, **flags.api_options(args, check))
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True, allow_nan=False))  # strict JSON
    else:
        from resumerge.cli.render import show_check

        show_check(report)
    return report.exit_code
