"""One row per command (issue 98): the parser, the dispatch and the command reference read the one table of
commands (:func:`resumerge.cli.parsers.commands`); a new command is its module and one row, shown by a toy command
plugged in from outside as the toy codec is (a new analysis's command is its row of the analyses' table:
tests/test_toy_analysis.py)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import types

import pytest

from resumerge.cli import parsers, reference
from resumerge.cli.commands import main
from resumerge.cli.parsers import Command, commands


def test_every_row_names_a_runner_that_exists() -> None:
    for name, command in commands().items():
        assert command.name == name
        module, function = command.runs.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def _toy_module() -> types.ModuleType:
    toy = types.ModuleType("toy_command")
    toy.HELP = "count the words of TEXT"  # type: ignore[attr-defined]
    toy.DESCRIPTION = "A toy command: its module and one row of the table."  # type: ignore[attr-defined]

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("text", metavar="TEXT")

    def run(args: argparse.Namespace) -> int:
        print(len(args.text.split()))
        return 0

    toy.add_arguments = add_arguments  # type: ignore[attr-defined]
    toy.run = run  # type: ignore[attr-defined]
    return toy


def test_a_new_command_is_its_module_and_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "toy_command", _toy_module())
    monkeypatch.setattr(parsers, "_OWN", (*parsers._OWN, Command("toy", "toy_command", "toy_command:run")))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["toy", "three small words"]) == 0
    assert out.getvalue() == "3\n"
    sub = next(a for a in parsers.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "toy" in sub.choices  # the whole parser (resumerge --help) lists it
    text = reference.render()  # the command reference (docs/commands.md) reads the same row
    assert "| [`toy`](#resumerge-toy) | count the words of TEXT |" in text and "## resumerge toy\n" in text
