"""docs/commands.md is the parsers' own reference: every command and flag ``--help`` knows, and the exit codes."""

from __future__ import annotations

import argparse
from pathlib import Path

from resumerge.cli.parsers import build_parser, commands
from resumerge.cli.reference import render
from resumerge.errors import EXIT_CODES, EXIT_MEANINGS

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "commands.md"


def test_the_page_is_what_the_parsers_render() -> None:
    """A flag added, renamed or re-described without ``python -m resumerge.cli.reference > docs/commands.md``."""
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/commands.md is behind the parsers: python -m resumerge.cli.reference > docs/commands.md")


def test_every_flag_of_every_command_is_on_the_page() -> None:
    page = PAGE.read_text(encoding="utf-8")
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(commands())
    for name, parser in subparsers.choices.items():
        section = page.split(f"## resumerge {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in section, f"resumerge {name} {flag}"


def test_every_exit_code_has_a_meaning() -> None:
    assert {code for _, code in EXIT_CODES} <= set(EXIT_MEANINGS)
    assert all(f"| {code} |" in PAGE.read_text(encoding="utf-8") for code in EXIT_MEANINGS)
