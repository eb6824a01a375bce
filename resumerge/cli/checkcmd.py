"""``resumerge check MODEL``: its options, its one :func:`resumerge.api.check` call, and its output (the human
table, or ``--json``); the exit code is the verdict's (0 works, 5 no effect, 6 broken)."""

from __future__ import annotations

import argparse
import json

from resumerge.cli.executorflags import RAY_NEEDS, add_executor_flags


def add_check_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``check`` command's parser."""
    check = sub.add_parser(
        "check", help="does the merge in MODEL work? compare it with its base and parents, layer by layer",
        description="A static pass over MODEL's tensors and a forward pass, one decoder layer of one model at a "
                    "time, of MODEL, its base and its parents over the same texts: NLL, KL, top-1 agreement, "
                    "per-layer drift, and the first layer that departs from every parent. Exit 0 works, 5 no "
                    "effect, 6 broken, 2 bad input, 3 interrupted (run it again: it resumes at the layer "
                    "reached), 4 a hub file whose bytes are not the hub's (its sha256), or the same check "
                    "already under way in another process (named).")
    check.add_argument("model", metavar="MODEL", help="the merged model's folder, a GGUF file, or a hub repo as "
                       "hf://NAMESPACE/NAME[@REVISION] (a GGUF file in one as hf://NAMESPACE/NAME/PATH.gguf"
                       "[@REVISION]), read by byte range (a resumerge output names its base and parents in its "
                       "record; its model card gets the check's section)")
    check.add_argument("--base", metavar="BASE", help="the base model's folder, GGUF file or hf:// repo")
    check.add_argument("--parent", dest="parents", metavar="P", action="append", default=[],
                       help="a parent model's folder, GGUF file or hf:// repo (repeat for each)")
    check.add_argument("--prompts", metavar="FILE", help="texts to run, one per line, no chat template "
                       "(default: built-in short chat, code, maths and multilingual texts)")
    check.add_argument("--truncate-texts", action="store_true",
                       help="cut each text longer than the models' context (max_position_embeddings) to its first "
                            "tokens, rather than refuse it (exit 2, naming its line)")
    check.add_argument("--max-memory", metavar="SIZE", help="memory budget for the whole process (e.g. 4GB; "
                       "default: most of what is free)")
    check.add_argument("--state-dir", metavar="DIR", help="where the check's journal is kept")
    check.add_argument("--device", default="cpu", metavar="DEVICE",
                       help="where the layers run: cpu, or cuda[:N] (each layer moved to the GPU while it runs, the "
                            "hidden states kept there: a model larger than the GPU's memory runs on it; not with "
                            "--executor ray) [default: cpu]")
    check.add_argument("--max-gpu-memory", metavar="SIZE", help="GPU memory budget with --device cuda [default: 85 "
                       "%% of the GPU's free memory]")
    add_executor_flags(check, where=f"where the forward pass runs: this process, one model after another, or each "
                                    f"model on a node of its own of a Ray cluster ({RAY_NEEDS}; the models on paths "
                                    "every node sees, or hf://); the report is the same, and a check started with one "
                                    "resumes with the other", address="the check")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (in a terminal a bar with "
                       "the layer, the model and the time left; in a log one line per layer), only the report")


def run_check_command(args: argparse.Namespace) -> int:
    """Parse nothing more: one API call, then the report."""
    from resumerge.api import Resources, check
    from resumerge.api.options import executor_option
    from resumerge.cli.checkprogress import CheckProgress

    progress = CheckProgress(quiet=args.quiet)
    try:
        report = check(args.model, base=args.base, parents=tuple(args.parents), prompts=args.prompts,
                       resources=Resources(max_memory=args.max_memory, device=args.device,
                                           max_gpu_memory=args.max_gpu_memory), state_dir=args.state_dir,
                       executor=executor_option(args.executor, ray_address=args.ray_address),
                       truncate_texts=args.truncate_texts, progress=progress)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True, allow_nan=False))  # strict JSON
    else:
        from resumerge.cli.render import show_check

        show_check(report)
    return report.exit_code
