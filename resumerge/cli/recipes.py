"""The commands on a multi-document recipe (mergekit-multi): ``run``, ``resume``, ``status`` and ``plan`` when
CONFIG holds several YAML documents or OUT holds a recipe's record. OUT may be a folder or an ``hf://`` repo.

Each command calls one library function (:mod:`resumerge.engine.recipe_run`,
:mod:`resumerge.engine.recipe_estimate`, :mod:`resumerge.store.recipeview`); :mod:`resumerge.cli.commands`
decides which module answers and maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from resumerge.cli.knobs import (
    Progress,
    fits_exit_code,
    installed_stop_flag,
    quiet_hub_uploads,
    run_settings,
)
from resumerge.errors import EXIT_OK, UsageError

if TYPE_CHECKING:
    from resumerge.plan.merge_plan import PlanOptions


def run_recipe_command(args: argparse.Namespace, text: str, options: PlanOptions) -> int:
    """``resumerge run RECIPE OUT``: every stage, the final one into OUT."""
    from resumerge.engine.recipe_run import run_recipe

    quiet_hub_uploads(args.out)
    stop = installed_stop_flag()
    with Progress(args.quiet) as progress:
        outcome = run_recipe(text, args.out, options, run_settings(args), intermediate_dir=args.intermediate_dir,
                             restart=args.restart, cleanup=args.cleanup_intermediates, reporter=progress,
                             should_stop=stop, source=os.path.basename(args.config))
    _finished(outcome, args.quiet)
    return EXIT_OK


def resume_recipe_command(args: argparse.Namespace) -> int:
    """``resumerge resume OUT`` for a recipe's OUT: every stage still to do."""
    from resumerge.engine.recipe_run import resume_recipe

    quiet_hub_uploads(args.out)
    stop = installed_stop_flag()
    with Progress(args.quiet) as progress:
        outcome = resume_recipe(args.out, run_settings(args), cleanup=args.cleanup_intermediates,
                                reporter=progress, should_stop=stop)
    _finished(outcome, args.quiet)
    return EXIT_OK


def recipe_status_command(args: argparse.Namespace) -> int:
    """``resumerge status OUT [--json]`` for a recipe's OUT: every stage, and the one in progress."""
    from resumerge.store.recipeview import read_recipe_status

    report = read_recipe_status(args.out, args.state_dir)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        from resumerge.cli.render import show_recipe_status

        show_recipe_status(report)
    return EXIT_OK


def plan_recipe_command(args: argparse.Namespace, text: str, options: PlanOptions) -> int:
    """``plan`` for a multi-document recipe: every stage validated and estimated; exit 2 when it will not fit."""
    from resumerge.engine.recipe_estimate import estimate_recipe
    from resumerge.memory.sizes import parse_size

    if args.out is None:
        raise UsageError("planning a recipe needs OUT: its stages are placed relative to it",
                         hint=f"resumerge plan {args.config} OUT")
    result = estimate_recipe(text, options, run_settings(args, output=False), out_dir=args.out, source=args.config,
                             intermediate_dir=args.intermediate_dir,
                             probe_bytes=parse_size(args.probe_size, option="--probe-size"))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        from resumerge.cli.render import show_plan

        for stage in result.stages:
            print(f"{stage.label}{' (final)' if stage.final else ''} -> {stage.out_dir}")
            show_plan(stage.estimate)
            print()
    return fits_exit_code(result.fits, result.reasons)


def _finished(outcome: object, quiet: bool) -> None:
    from resumerge.engine.recipe_run import RecipeOutcome

    assert isinstance(outcome, RecipeOutcome)
    if quiet:
        return
    merged = sum(1 for s in outcome.stages if s.action == "merged")
    where = outcome.final.target or outcome.final.out_dir
    print(f"done: {where} ({len(outcome.plan.stages)} stages, {merged} merged in this run)", file=sys.stderr)
