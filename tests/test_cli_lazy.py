"""A command line that starts with a command builds that command's parser alone (issue 72: ``resumerge status``
under 0.2 s), and every command's ``--help``, usage and errors stay byte for byte what the whole parser gives."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys

import pytest

from resumerge.cli.commands import build_parser, commands, main


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _said(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help: argparse exits 0 after printing
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_the_whole_parser_lists_every_command_in_order() -> None:
    assert list(_commands(build_parser())) == list(commands())
    for name in commands():  # asked for one command, the parser holds that one only
        assert list(_commands(build_parser(name))) == [name]
    assert list(_commands(build_parser("no-such-command"))) == list(commands())


@pytest.mark.parametrize("name", list(commands()))
def test_a_command_alone_helps_and_parses_as_within_the_whole(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps at the terminal's width: the same for both
    whole, alone = _commands(build_parser())[name], _commands(build_parser(name))[name]
    assert alone.format_help() == whole.format_help()
    assert alone.format_usage() == whole.format_usage()
    assert [(a.dest, a.option_strings, a.default) for a in alone._actions] == \
        [(a.dest, a.option_strings, a.default) for a in whole._actions]


def test_main_prints_the_same_help_usage_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    top = _said(["--help"])
    assert top[0] == 0 and all(f"    {name}" in top[1] for name in commands())  # the whole parser answers
    status = _said(["status", "--help"])
    assert status[0] == 0 and status[1] == _commands(build_parser())["status"].format_help()
    # errors name the command's own usage, built alone
    assert _said(["status"]) == (2, "", _commands(build_parser())["status"].format_usage()
                                 + "resumerge status: error: the following arguments are required: OUT\n")
    assert _said(["status", "x", "--bogus"])[2].endswith("resumerge status: error: unrecognized arguments: --bogus\n")
    code, _, err = _said(["no-such-command"])
    assert code == 2 and "invalid choice: 'no-such-command'" in err and "'run', 'resume', 'status'" in err


def test_the_api_imports_its_calls_on_first_use_and_keeps_every_name() -> None:
    """``resumerge.api`` imports every public name on its first use (issue 72), ``status``'s module included:
    each name of ``__all__`` is still there, from ``from resumerge.api import X``, ``api.X`` and ``dir(api)``, and is
    the object its own module defines."""
    probe = (
        "import sys\n"
        "from resumerge import api\n"
        "early = sorted(m for m in ('resumerge.api.options', 'resumerge.api.calls', 'resumerge.config.settings')\n"
        "               if m in sys.modules)\n"
        "from resumerge.api import run, Resources\n"
        "from resumerge.api.calls import run as own_run\n"
        "from resumerge.api.options import Resources as own_resources\n"
        "missing = [n for n in api.__all__ if getattr(api, n, None) is None or n not in dir(api)]\n"
        "import resumerge\n"
        "print(early, run is own_run is api.run is resumerge.run, Resources is own_resources, missing)\n"
        "try:\n"
        "    api.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["[] True True []", "module 'resumerge.api' has no attribute 'no_such_name'"], \
        done.stdout + done.stderr
