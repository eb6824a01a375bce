"""Every example of the topic pages runs as it is after ``resumerge demo tour`` (docs/*.md say so in their first
lines): each ```bash block that starts with that command, line by line in a folder of its own, each ``resumerge``
command exiting 0 (or with one of ``check``'s verdicts), and each ```python block of the same page that names
``tour/`` after it. A page whose example stops working fails here, not in a reader's shell. Examples that need what
a test cannot have (a hub, a lm-eval dataset, a cluster) are plain ``` blocks, which are not run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import cli, cli_here

from resumerge.errors import EXIT_BROKEN, EXIT_NO_EFFECT, EXIT_OK

DOCS = Path(__file__).resolve().parents[1] / "docs"
TOUR = "resumerge demo tour"
# `check`'s verdicts are answers, not failures (the tour's two random models are no merge of each other).
_ANSWERS = {"check": {EXIT_OK, EXIT_NO_EFFECT, EXIT_BROKEN}}
# Pages whose example the Ray tests run instead, on the suite's Ray head: a Ray started for each command here took
# minutes on a loaded machine (ray.md's `run --executor ray`: tests/test_ray_executor.py; its `check --executor ray`:
# tests/check/test_ray_check.py).
_ELSEWHERE = {"ray.md"}
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _examples(page: Path) -> tuple[list[str], list[str]]:
    """The page's runnable bash blocks and its python blocks that name ``tour/``."""
    blocks = _FENCE.findall(page.read_text(encoding="utf-8"))
    return ([body for info, body in blocks if info == "bash" and body.startswith(TOUR)],
            [body for info, body in blocks if info == "python" and "tour/" in body])


PAGES = [page.name for page in sorted(DOCS.glob("*.md")) if _examples(page)[0]]


def _steps(block: str) -> list[str]:
    """The block's commands: one a line, a here-document kept whole with the line that opens it."""
    steps, lines = [], block.splitlines()
    while lines:
        line = lines.pop(0)
        if match := re.search(r"<<\s*'?(\w+)'?", line):
            end = lines.index(match.group(1))
            line, lines = "\n".join([line, *lines[:end + 1]]), lines[end + 1:]
        steps.append(line)
    return steps


def _run(step: str, where: Path) -> None:
    """A ``resumerge`` command (several joined by ``&&``, stdout maybe redirected to a file) through the suite's
    CLI runner; any other line (printf, cat <<EOF) through bash."""
    if not step.startswith("resumerge "):
        subprocess.run(["bash", "-euc", step], cwd=where, check=True)
        return
    for command in step.split("#", 1)[0].split("&&"):
        words = shlex.split(command)
        target = None
        if ">" in words:
            at = words.index(">")
            words, target = words[:at], words[at + 1]
        done = cli(*words[1:], timeout=600)
        assert done.returncode in _ANSWERS.get(words[1], {EXIT_OK}), (command, done.returncode,
                                                                       done.stdout[-2000:], done.stderr[-2000:])
        if target is not None:
            (where / target).write_text(done.stdout, encoding="utf-8")


def _tour(monkeypatch: pytest.MonkeyPatch) -> None:
    """``resumerge demo tour`` in this process (:func:`support.cli_here`), as a reader's shell runs it, the
    ``resumerge`` interpreters it starts recorded: the run it kills is the only one, killed as it said (its status,
    resume, verify and uninterrupted run are the same commands in the demo's own process; six fresh interpreters
    cost a demo 6-8 CPU s of torch imports)."""
    started: list[tuple[list[str], dict[str, str]]] = []
    start = subprocess.Popen.__init__

    def recorded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
        if argv[1:3] == ["-m", "resumerge"]:
            started.append((argv, dict(kwargs.get("env") or {})))
        start(self, args, *rest, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(subprocess.Popen, "__init__", recorded)
        done = cli_here(*shlex.split(TOUR)[1:])
    assert done.returncode == EXIT_OK, (done.stdout[-2000:], done.stderr[-2000:])
    assert "byte-identical to the uninterrupted run: yes" in done.stdout, done.stdout
    assert [(argv[:4], env.get("RESUMERGE_KILL_AT")) for argv, env in started] == [
        ([sys.executable, "-m", "resumerge", "run"], "after_manifest_write:2")], started
    assert "the merge process died (exit status -9)" in done.stdout, done.stdout


def _run_pages(pages: list[str], where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples of ``pages`` after one ``resumerge demo tour`` in ``where`` (:func:`_tour`): each page in a
    folder of its own (pages write the same names: merged/, texts.txt) where ``tour`` links to that one (each page's
    first line, the tour again, skipped)."""
    monkeypatch.chdir(where)
    _tour(monkeypatch)
    for page in pages:
        folder = where / page.removesuffix(".md")
        folder.mkdir()
        (folder / "tour").symlink_to(where / "tour", target_is_directory=True)
        monkeypatch.chdir(folder)
        bash, python = _examples(DOCS / page)
        for block in bash:
            for step in _steps(block)[1:]:
                _run(step, folder)
        for number, block in enumerate(python):
            # `python example.py` in the page's folder, as a reader saves and runs it (the folder first on the
            # path, as `python -c` puts the working directory): forked from the worker's fork server (torch
            # imported once) like the page's commands, where `python -c` paid a fresh interpreter's imports
            script = folder / f"example-{number}.py"
            script.write_text(block, encoding="utf-8")
            done = cli(script=script, timeout=600)
            assert done.returncode == 0, (page, block, done.stdout[-2000:], done.stderr[-2000:])


def test_every_example_of_the_pages_runs_after_the_tour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_pages([page for page in PAGES if page not in _ELSEWHERE], tmp_path, monkeypatch)


def test_the_pages_that_say_their_examples_run_have_one_that_does() -> None:
    """Each page opening with "Every example on these pages runs as it is after `resumerge demo tour`" holds a
    block this module runs (a page whose only block lost its first line would be read and never run)."""
    claimed = [page.name for page in sorted(DOCS.glob("*.md"))
               if "Every example on these pages runs as it is after" in page.read_text(encoding="utf-8")]
    assert claimed and set(claimed) <= set(PAGES), sorted(set(claimed) - set(PAGES))


def test_a_page_that_says_its_examples_run_marks_those_that_cannot_plain() -> None:
    """On a page that says every example runs after the tour, a ```bash block that does not start with the tour or
    a ```python block that does not name ``tour/`` would be read as a runnable example and never run: it is a plain
    ``` block (or the tour's). YAML and data blocks are what the examples read, not examples."""
    unrun = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        if "Every example on these pages runs as it is after" not in text:
            continue
        for info, body in _FENCE.findall(text):
            if (info == "bash" and not body.startswith(TOUR)) or (info == "python" and "tour/" not in body):
                unrun.append(f"{page.name}: {body.splitlines()[0]}")
    assert not unrun, unrun
