"""The command reference (docs/commands.md), written from the parsers themselves: every command, every flag with its
help and default, and the exit codes, so the page cannot fall behind ``--help`` (tests/test_command_reference.py
fails when the file differs from what this renders).

``python -m resumerge.cli.reference > docs/commands.md`` writes it anew after a parser changes.
"""

from __future__ import annotations

import argparse
import sys

from resumerge.cli.parsers import build_parser
from resumerge.errors import EXIT_MEANINGS

_HEADER = """# Command reference

Every `resumerge` command and every flag, as `resumerge COMMAND --help` prints them. This page is generated from
the parsers (`python -m resumerge.cli.reference > docs/commands.md`); a test fails when it falls behind them.
The same options are keyword arguments of `resumerge.api` (a flag's words with `_` for `-`).
"""


def render() -> str:
    """The whole reference page, in Markdown."""
    parser = build_parser()
    commands = _subcommands(parser)  # every command, in the order `resumerge --help` lists them
    parts = [_HEADER, "## Commands\n", "| command | what it does |", "|---|---|"]
    helps = {choice.dest: choice.help or "" for choice in _subparsers_action(parser)._choices_actions}
    parts += [f"| [`{name}`](#resumerge-{name}) | {_cell(helps.get(name, ''))} |" for name in commands]
    parts.append("")
    for name in commands:
        parts.append(_command(name, commands[name]))
    parts += ["## Exit codes\n", "| code | meaning |", "|---|---|"]
    parts += [f"| {code} | {_cell(meaning)} |" for code, meaning in sorted(EXIT_MEANINGS.items())]
    return "\n".join(parts) + "\n"


def _subparsers_action(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(_subparsers_action(parser).choices)


def _command(name: str, parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    usage = " ".join(parser.format_usage().split())
    usage = usage.removeprefix("usage: ")
    lines = [f"## resumerge {name}\n", f"```\n{usage}\n```\n"]
    if parser.description:
        lines.append(" ".join(parser.description.split()) + "\n")
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    positional = [a for a in shown if not a.option_strings]
    optional = [a for a in shown if a.option_strings]
    if positional:
        lines += ["| argument | meaning |", "|---|---|"]
        lines += [f"| `{a.metavar or a.dest}` | {_cell(_help(formatter, a))} |" for a in positional]
        lines.append("")
    if optional:
        lines += ["| flag | meaning |", "|---|---|"]
        lines += [f"| {_flags(a)} | {_cell(_help(formatter, a))} |" for a in optional]
        lines.append("")
    hidden = sorted(s for a in parser._actions if a.help == argparse.SUPPRESS for s in a.option_strings)
    if hidden:
        lines.append("Accepted as mergekit's command line spells them, and ignored (resumerge has no need of them): "
                     + ", ".join(f"`{flag}`" for flag in hidden) + ".\n")
    return "\n".join(lines)


def _flags(action: argparse.Action) -> str:
    value = ""
    if action.nargs != 0:
        metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
        value = f" {metavar}"
    return ", ".join(f"`{flag}{value}`" for flag in action.option_strings)


def _help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    text = formatter._expand_help(action) if action.help else ""
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        choices = ", ".join(f"`{c}`" for c in action.choices)
        text = f"{text} (one of {choices})" if text else f"one of {choices}"
    return " ".join(text.split())


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(render())
