"""One front door: every CLI command is one :mod:`resumerge.api` call, so each command's options are its API
function's options — its own parameters and the fields of its option groups it honours (read from the parser, the
signatures and the groups, never typed out here) — and the API keeps every guard the CLI has."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import write_config

from resumerge import api
from resumerge.api.flagmap import group_parameters, grouped, options_of
from resumerge.api.options import GROUPS
from resumerge.cli import flags
from resumerge.cli.commands import build_parser, main
from resumerge.errors import EXIT_REFUSED, OutputDirError, UsageError

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "run": api.run,
    "resume": api.resume,
    "status": api.status,
    "verify": api.verify,
    "plan": api.estimate,
    "extract-lora": api.extract_lora,
    "tokensurgeon": api.tokensurgeon,
    "check": api.check,
    "eval": api.evaluate,
    "evolve": api.evolve,
}
# Options that change what the terminal shows, not what is done: the command's name, --quiet, --json and
# mergekit's -v. The mergekit flags resumerge accepts only to ignore them have dests named unneeded_*.
CLI_ONLY = {"command", "quiet", "json", "v_flag"}
# Parameters that are objects, not options: the caller's progress display and stop flag (the CLI passes its own),
# the free-space reading tests replace, whether this process was started for the estimate (the CLI's was), and
# the table of stored formats a notebook plugs its own format into, and the lm-eval task index a notebook
# evaluating several models reuses (a command evaluates once: it builds its own).
API_ONLY = {"progress", "should_stop", "disk_free", "fresh_process", "codecs", "task_index"}


def _subparser(command: str) -> argparse.ArgumentParser:
    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = actions[0].choices[command]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def _dests(command: str) -> set[str]:
    """The API parameters the command's options fill: each its own, but the executor's settings, which the command
    folds into the executor object (``--ray-address`` into ``executor=RayExecutor(address=...)``)."""
    dests = {a.dest for a in _subparser(command)._actions if not isinstance(a, argparse._HelpAction)}
    return {flags.FOLDED.get(d, d) for d in dests if not d.startswith("unneeded_")} - CLI_ONLY


def _parameters(function: Callable[..., Any]) -> set[str]:
    return options_of(function) - API_ONLY


@pytest.mark.parametrize("command", sorted(FUNCTIONS))
def test_cli_options_match_api_parameters(command: str) -> None:
    dests, parameters = _dests(command), _parameters(FUNCTIONS[command])
    assert dests == parameters, (f"{command}: only the CLI has {sorted(dests - parameters)}, "
                                 f"only the API has {sorted(parameters - dests)}")


@pytest.mark.parametrize("command", sorted(FUNCTIONS))
def test_errors_name_each_option_by_its_api_keyword(command: str) -> None:
    """str(error) is what a notebook reads: each flag an error names is the keyword the API function takes."""
    for action in _subparser(command)._actions:
        if action.dest in CLI_ONLY or action.dest.startswith("unneeded_") or not action.option_strings:
            continue
        for flag in action.option_strings:
            if not flag.startswith("--") or isinstance(action, argparse._HelpAction):
                continue
            said = str(UsageError(f"{flag} is wrong"))
            if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._StoreTrueAction):
                value = action.const
                assert said == f"{action.dest}={value!r} is wrong", said
            else:
                assert said.split(" ")[0].split("=")[0] == action.dest, (flag, said)
                off = isinstance(action, argparse._StoreFalseAction) or (
                    isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-"))
                assert said.endswith("=False is wrong") == off, said
    assert str(UsageError("-j/--num-threads must be at least 1")) == "num_threads must be at least 1"


def test_the_cli_leaves_out_exactly_the_presentation_options() -> None:
    # The command passes every other parsed option to the API by name: the two lists are one.
    assert flags.CLI_ONLY == CLI_ONLY
    args = build_parser().parse_args(["run", "c.yml", "out", "--quiet", "--no-cuda", "-j", "2", "--no-staging"])
    passed = flags.api_options(args, api.run)
    inspect.signature(api.run).bind(**passed)  # raises TypeError on any name api.run does not take
    assert passed["settings"].resources == api.Resources(num_threads=2, staging=False) and "quiet" not in passed


def _recipe_out(tmp_path: Path) -> tuple[Path, Path, str]:
    out = tmp_path / "out"
    out.mkdir()
    record = out / "resumerge-recipe.json"
    text = json.dumps({"recipe": "a stand-in: only its presence matters to the refusal"})
    record.write_text(text)
    # Models that do not exist: the refusal comes before anything is read or planned.
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(tmp_path / "a"), "parameters": {"weight": 1.0}},
        {"model": str(tmp_path / "b"), "parameters": {"weight": 1.0}}]})
    return out, cfg, text


def test_api_run_refuses_a_single_merge_into_a_recipes_out_even_with_restart(tmp_path: Path) -> None:
    out, cfg, text = _recipe_out(tmp_path)
    with pytest.raises(OutputDirError, match="holds the output of a recipe"):
        api.run(cfg, out, settings=api.Settings(state_dir=tmp_path / "state"), restart=True)
    assert main(["run", str(cfg), str(out), "--state-dir", str(tmp_path / "state"), "--restart"]) == EXIT_REFUSED
    assert sorted(p.name for p in out.iterdir()) == ["resumerge-recipe.json"]
    assert (out / "resumerge-recipe.json").read_text() == text


@pytest.mark.parametrize(("options", "message"), [
    ({"commit_every": 0}, r"^commit_every must be at least 1"),  # named as the API names it
    ({"num_threads": 0}, r"^num_threads must be at least 1"),
    ({"max_memory": "0"}, r"^max_memory must be positive"),
    ({"intermediate_dir": "stages"}, "applies to recipes only"),
])
def test_the_api_keeps_the_guards_the_cli_had(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(tmp_path / "a"), "parameters": {"weight": 1.0}}]})
    with pytest.raises(UsageError, match=message):
        api.run(cfg, tmp_path / "out", **grouped(api.run, {"state_dir": tmp_path / "state", **options}))
    assert not (tmp_path / "out").exists()


def test_each_option_is_one_field_of_one_group_and_a_flag() -> None:
    # grouped() packs a flag into the group with a field of its name: a name in two groups one function honours
    # would be ambiguous (evolve's Search.random_seed and run's Merging.random_seed never meet: Settings.merging is
    # not evolve's), and a field no command has a flag for would be an option the CLI lacks (a new option: its field
    # and its flag).
    for function in FUNCTIONS.values():
        names = [leaf for name, group in group_parameters(function).items()
                 for leaf in _leaves_listed(group, function.__name__)]
        assert len(names) == len(set(names)), (function.__name__, sorted(n for n in names if names.count(n) > 1))
    names = [each.name for group in GROUPS if group is not api.Settings for each in dataclasses.fields(group)]
    flags = set().union(*(_dests(command) for command in FUNCTIONS))
    assert set(names) <= flags, sorted(set(names) - flags)


def _leaves_listed(group: type, function: str) -> list[str]:
    """Every option of ``group`` that ``function`` honours, those of the groups it holds included, repeats kept."""
    found: list[str] = []
    for each in dataclasses.fields(group):  # type: ignore[arg-type]
        if function in each.metadata.get("not_for", ()):
            continue
        inner = type(each.default)
        found += _leaves_listed(inner, function) if inner in GROUPS else [each.name]
    return found


@pytest.mark.parametrize(("call", "refused"), [
    (lambda out: api.resume(out, settings=api.Settings(resources=api.Resources(device="cuda"))),
                            "device does not apply to resume"),
    (lambda out: api.resume(out, settings=api.Settings(hub=api.Hub(public=True))), "public does not apply to resume"),
    (lambda out: api.extract_lora("a", "b", out, settings=api.Settings(output=api.Output(out_shard_size="1GB"))),
     "out_shard_size does not apply to extract_lora"),
    (lambda out: api.estimate("c.yml", out, settings=api.Settings(stages=api.Stages(cleanup_intermediates=True))),
     "cleanup_intermediates does not apply to estimate"),
    # a whole group of Settings a call does not take: refused as one of its fields is
    (lambda out: api.evolve("c.yml", out, api.Settings(merging=api.Merging(allow_crimes=True))),
     "merging does not apply to evolve"),
    (lambda out: api.resume(out, api.Settings(output=api.Output(copy_tokenizer=False))),
     "output does not apply to resume"),
])
def test_a_group_field_a_function_cannot_honour_is_refused(tmp_path: Path, call: Callable[[Path], object],
                                                           refused: str) -> None:
    # Before anything is read: the models and the config named here do not exist.
    with pytest.raises(UsageError, match=refused):
        call(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_groups_are_what_the_cli_passes() -> None:
    args = build_parser().parse_args(["extract-lora", "--model", "ft", "--base-model", "base", "--out-path", "o",
                                      "--max-rank", "8", "--max-memory", "2GB", "--public", "--plan"])
    passed = flags.api_options(args, api.extract_lora)
    assert passed["lora"] == api.Lora(max_rank=8) and passed["settings"].resources.max_memory == "2GB"
    assert passed["settings"].hub.public and passed["plan"] and passed["model"] == "ft"
