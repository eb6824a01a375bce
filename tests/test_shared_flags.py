"""The flags several commands share are declared once (:mod:`resumerge.cli.flags`): wherever a command takes one, it
has the one help text, default and metavar (issue 83: ``--state-dir`` was declared 7 times with 6 help texts,
``--max-memory`` 6 times), and the settings they give reach the API as one object."""

from __future__ import annotations

import argparse

import pytest

from resumerge import api
from resumerge.cli import flags
from resumerge.cli.parsers import build_parser, commands

SHARED = [value for value in vars(flags).values() if isinstance(value, flags.Flag)]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in commands()}


def _taken(option: str) -> dict[str, argparse.Action]:
    """Each command's action of ``option``, for the commands that take it."""
    return {name: action for name, parser in _commands().items() for action in parser._actions
            if option in action.option_strings}


@pytest.mark.parametrize("flag", SHARED, ids=lambda f: f.names[-1])
def test_a_shared_flag_is_the_same_wherever_a_command_takes_it(flag: flags.Flag) -> None:
    taken = _taken(flag.names[-1])
    assert len(taken) >= 2, f"{flag.names[-1]}: one command only, no need to share it"
    for command, action in taken.items():
        assert tuple(action.option_strings) == flag.names, command
        for key in ("help", "metavar", "default", "dest"):
            if key in flag.options:
                assert getattr(action, key) == flag.options[key], (command, key)


@pytest.mark.parametrize("option", ["--state-dir", "--max-memory", "--device", "--max-gpu-memory", "--executor",
                                    "--ray-address", "--transformers-cache", "--truncate-texts"])
def test_the_options_every_pass_command_repeats_have_one_help(option: str) -> None:
    helps = {command: action.help for command, action in _taken(option).items()}
    assert len(set(helps.values())) == 1, helps


def test_every_pass_and_run_command_takes_the_state_dir_and_the_memory_budget() -> None:
    for command in ("run", "resume", "plan", "extract-lora", "tokensurgeon", "check", "eval", "measure", "evolve"):
        assert {"--state-dir", "--max-memory"} <= {o for a in _commands()[command]._actions for o in a.option_strings}


@pytest.mark.parametrize(("command", "call"), [("check", api.check), ("eval", api.evaluate), ("evolve", api.evolve)])
def test_the_pass_flags_reach_the_api_as_one_resources_object(command: str, call: object) -> None:
    words = {"check": ["m"], "eval": ["m", "--tasks", "t"], "evolve": ["c.yml", "s"]}[command]
    device = [] if command == "evolve" else ["--max-gpu-memory", "3GB"]
    args = build_parser().parse_args([command, *words, "--max-memory", "2GB", "--device", "cuda:1", *device,
                                      "--state-dir", "st", "--executor", "local"])
    passed = flags.api_options(args, call)  # type: ignore[arg-type]
    # every call takes them in its one Settings
    held = vars(passed.pop("settings"))
    assert held["resources"] == api.Resources(max_memory="2GB", device="cuda:1",
                                              max_gpu_memory=None if command == "evolve" else "3GB")
    assert held["state_dir"] == "st" and held["executor"] is None
    assert not {"max_memory", "device", "max_gpu_memory", "ray_address"} & set(passed)
