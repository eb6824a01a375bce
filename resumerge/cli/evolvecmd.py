"""``resumerge evolve CONFIG STORAGE``: its options, its one :func:`resumerge.api.evolve` call and what it prints
(``resumerge status STORAGE`` for a search is :func:`resumerge.api.status`'s, through the analyses table)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from resumerge.cli import flags
from resumerge.cli.parsers import out_format_flags
from resumerge.errors import EXIT_OK

OPT_IN = "--i-understand-the-depths-of-the-evils-i-am-unleashing"


# The command's line in ``resumerge --help`` and the opening of its own ``--help``.
HELP = "search a merge's parameters with CMA-ES (a mergekit-evolve config), or a model's layer path, resumable"
DESCRIPTION = ("Search the parameters of the merge a mergekit-evolve CONFIG describes (its genome: models, "
               "merge_method, base_model, layer_granularity, filters, smooth, ...) with CMA-ES, scoring each "
               "candidate on the config's tasks: {kl: {parent: PATH, texts: FILE}} (KL from that parent on "
               "its own texts, one per line, as eval's kl:PARENT:FILE measures it: a parent of another "
               "vocabulary over the tokens both hold) and {nll: {texts: FILE}}, weighted. Everything is kept in "
               "STORAGE (evaluations.jsonl and .csv, best.yml, objective.png): killed anywhere, the same "
               "command resumes and ends with the same files; resumerge status STORAGE says where it is. "
               "Progress on stderr: a line per layer of a generation's pass and per candidate scored, with "
               "the best objective so far and the time left (--quiet: none). "
               "A genome of kind: structure searches a model's layer path instead (blocks repeated, skipped or "
               "swapped for another source's, optionally scaled, written as a slices: config): every single "
               "block, then a beam over compositions, then optionally CMA-ES over the front's scales, each "
               "candidate scored (nll, kl, lm-eval tasks) from the base's hidden states cached in STORAGE "
               "(--max-disk bounds them); front.json holds the size/score Pareto front (docs/evolve.md). "
               "A parameter genome with a structure: block beside it searches both, one after the other: the "
               "parameters with CMA-ES (STORAGE/parameters), their best merged by run, then that merge's layer "
               "path (STORAGE/structure); best.yml (and --merge-best) is the combined recipe. "
               "Exit 0 done, 2 bad input (before any weight is read), 3 interrupted (run it again).")


def add_arguments(evolve: argparse.ArgumentParser) -> None:
    """CONFIG and STORAGE, CMA-ES's options, where its passes run, --merge-best, the trackers and the
    output's form."""
    evolve.add_argument("config", metavar="CONFIG", help="the mergekit-evolve YAML config")
    evolve.add_argument("storage", metavar="STORAGE", help="the folder that keeps the search (new or this search's)")
    evolve.add_argument("--max-fevals", type=int, default=100, metavar="N",
                        help="evaluations after which the search ends, exactly: where fewer than a generation are "
                             "left, the last generation scores only that many of its candidates (cma's own stop "
                             "criteria may end it earlier) [default: 100]")
    evolve.add_argument("--popsize", type=int, metavar="P",
                        help="candidates per generation, 2 or more [default: cma's 4 + 3 ln(dimensions)]")
    evolve.add_argument("--sigma0", type=float, default=1 / 6, metavar="S",
                        help="CMA-ES's first step size [default: 1/6]")
    evolve.add_argument("--random-seed", type=int, default=0, metavar="N", help="seed of CMA-ES's draws [default: 0]")
    flags.add(evolve, flags.MAX_MEMORY, flags.STATE_DIR, flags.DEVICE, flags.MAX_DISK)
    flags.add_executor(evolve)
    evolve.add_argument("--merge-best", metavar="OUT", help="write the best candidate's merge into OUT, as run does")
    out_format_flags(evolve)  # how --merge-best is written
    evolve.add_argument(OPT_IN, dest="allow_benchmark_tasks", action="store_true",
                        help="allow tasks named after common benchmarks (mmlu, hellaswag, arc_, ...) as objectives")
    evolve.add_argument("--task-search-path", metavar="DIR", help="a folder of lm-eval task YAMLs, for the config's "
                        "lm-eval task entries (as mergekit-evolve's --task-search-path)")
    evolve.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=False,
                        help="log the search to Weights & Biases, as mergekit-evolve's --wandb: a row per candidate "
                             "(genotype, figures, objective), a summary per generation, best.yml as an artifact; a "
                             "resumed search logs to the same run, each candidate once (needs the logging extra)")
    evolve.add_argument("--wandb-project", default="mergekit-evolve", metavar="NAME",
                        help="the W&B project [default: mergekit-evolve]")
    evolve.add_argument("--wandb-entity", metavar="NAME", help="the W&B entity (team or user) [default: yours]")
    evolve.add_argument("--trackio", action="store_true",
                        help="log the search to trackio as --wandb logs it (its local store, or the Space it is "
                             "told with TRACKIO_SPACE_ID)")
    evolve.add_argument("--trackio-project", default="resumerge-evolve", metavar="NAME",
                        help="the trackio project [default: resumerge-evolve]")
    evolve.add_argument("--json", action="store_true", help="print the best candidate as JSON")
    evolve.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (a line per layer of a "
                        "generation's pass and per candidate scored)")


def run_evolve_command(args: argparse.Namespace) -> int:
    """One API call, then the best candidate."""
    from resumerge.api import evolve
    from resumerge.cli.evolveprogress import EvolveProgress

    outcome = evolve(progress=EvolveProgress(quiet=args.quiet), **flags.api_options(args, evolve))
    if args.json:
        print(json.dumps(outcome.best.to_row(), indent=2))
        return EXIT_OK
    best = outcome.best
    if outcome.shape is not None:
        print(f"best of {outcome.candidates} candidates: {outcome.shape} (candidate {best.number}), objective "
              f"{best.objective:.6g}; the size/score front: {outcome.front}")
    else:
        print(f"best of {outcome.generations} generations: generation {best.generation}, candidate {best.number}, "
              f"objective {best.objective:.6g}")
    for name, value in best.tasks.items():
        print(f"  {name}: " + (f"{value:.6g}" if value is not None else "not finite"))
    print(f"its merge config: {Path(args.storage) / 'best.yml'}")
    if args.merge_best:
        print(f"merged into {args.merge_best}")
    return EXIT_OK

