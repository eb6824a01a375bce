"""What a new user meets in the first hour (issue 71, item 5): the install lines, the quickstart, the refusals that
name what to install. Each test here failed on the code before its fix; the friction items that are behaviours of a
command are tested beside that command (tests/test_killed_planning.py, tests/test_notebook.py, ...)."""

from __future__ import annotations

import re
from importlib import util
from pathlib import Path

import pytest
from support import cli, cli_here, linear_config, write_config

from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import InputError
from resumerge.forward.engine.requires import Needs, require_transformers

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_shows_resume_and_status_in_its_first_60_lines() -> None:
    """The quickstart a mergekit user looks for: run, and what to do after a kill."""
    top = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    for command in ("resumerge run ", "resumerge resume ", "resumerge status "):
        assert command in top, command


def test_the_readme_says_check_and_measure_need_transformers() -> None:
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    paragraph = next(p for p in install.split("\n\n") if "transformers" in p and "measure" in p)
    assert "`check`" in paragraph and "`measure`" in paragraph and "GGUF model's tokenizer" in paragraph
    assert "'.[check]'" in paragraph


def test_the_refusal_of_a_check_without_transformers_names_the_check_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(InputError) as refused:
        require_transformers(Needs("resumerge check"), load=False)
    line = refused.value.one_line()
    assert "pip install transformers" in line and "'.[check]'" in line and "moe" not in line, line
    extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1]
    assert re.search(r'^check = \["transformers>=', extras, re.MULTILINE)


def test_no_doc_installs_resumerge_from_a_package_index() -> None:
    """No package index has resumerge: an extra is installed from the clone (``pip install -c constraints.txt -e
    '.[moe]'``) or from a wheel (``'resumerge[moe] @ file://...'``); a doc showing ``pip install 'resumerge[moe]'``
    gives a command that cannot work, whatever sentence is around it."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "colab").glob("*.md"))]:
        for found in re.finditer(r"pip install '?resumerge\[[^\]]*\]'?", doc.read_text()):
            assert found.string[found.end():].startswith(" @"), f"{doc.name}: {found[0]}"


def test_the_venv_the_readme_makes_is_ignored_by_git() -> None:
    """The README makes ``.venv`` in the clone; untracked, its 5 GB of torch fill ``git status``."""
    assert "python3 -m venv .venv" in (ROOT / "README.md").read_text()
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert ignored & {".venv", ".venv/", "/.venv", "/.venv/"}


def test_a_resume_over_touched_inputs_says_so_once_per_file_by_folder(tmp_path: Path) -> None:
    """Two models' shards share their names: the line named each twice, without folders, right under one saying that
    no input file had changed (the stored plan's key compares mtimes; the proof compares ctimes too)."""
    spec = ModelSpec(layers=2, hidden=64, intermediate=128, vocab=128, shard_bytes=60_000)
    a, b = make_model(tmp_path / "m" / "a", spec, seed=1), make_model(tmp_path / "m" / "b", spec, seed=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--state-dir", state, "--out-shard-size", "40k", "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:2"})
    assert killed.returncode == -9, killed.stderr
    touched = sorted(p for p in [*a.iterdir(), *b.iterdir()] if p.suffix == ".safetensors")
    for path in touched:  # a new ctime, the same mtime and bytes
        path.chmod(path.stat().st_mode ^ 0o040)
    done = cli_here("resume", out, "--state-dir", state)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "no input file changed" not in said
    line = next(x for x in said.splitlines() if "touched since the run started" in x)
    assert line.startswith(f"{len(touched)} input files touched") and "hold the bytes they held then" in line, line
    assert f"{a}: " in line and f"{b}: " in line, line
    per_folder = [sum(p.parent == m for p in touched) for m in (a, b)]
    assert all(f"{n} files" in line for n in per_folder) or all(p.name in line for p in touched), line


def _measured_config(tmp_path: Path) -> Path:
    spec = ModelSpec(layers=1, hidden=32, intermediate=48, vocab=64)
    a, b = make_model(tmp_path / "a", spec, seed=1), make_model(tmp_path / "b", spec, seed=2)
    return write_config(tmp_path / "rm.yml", {"merge_method": "regmean", "models": [{"model": str(a)},
                                              {"model": str(b)}], "parameters": {"grams": str(tmp_path / "grams")}})


def test_measure_names_its_own_texts_flag_in_its_errors(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config = _measured_config(tmp_path)
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    for name, words in [("missing.txt", "cannot read --texts"), ("empty.txt", "--texts"),
                        ("latin1.txt", "cannot read --texts")]:
        done = cli_here("measure", config, tmp_path / "grams", "--texts", tmp_path / name)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert words in done.stderr and "--prompts" not in done.stderr, done.stderr


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-8-sig"])
def test_a_texts_file_saved_as_utf16_reads_as_its_utf8_copy(tmp_path: Path, encoding: str) -> None:
    """Configs accept UTF-16 with its byte-order mark (Windows editors, PowerShell's ``>``); the texts of check
    and measure were refused. The same texts measure to the same Grams (the measurement is reused)."""
    pytest.importorskip("transformers")
    from resumerge.forward.text.texts import load_tokenizer, sequences

    config = _measured_config(tmp_path)
    texts = "The capital of France is Paris.\nGuten Morgen, mein Freund — ça va?\n"
    (tmp_path / "utf8.txt").write_text(texts, encoding="utf-8")
    data = texts.encode(encoding)
    if encoding == "utf-16-be":
        data = b"\xfe\xff" + data
    (tmp_path / "other.txt").write_bytes(data)
    tokenizer = load_tokenizer([tmp_path / "a"])
    assert sequences(tokenizer, tmp_path / "other.txt") == sequences(tokenizer, tmp_path / "utf8.txt")
    first = cli_here("measure", config, tmp_path / "grams", "--texts", tmp_path / "utf8.txt")
    assert first.returncode == 0, first.stderr
    again = cli_here("measure", config, tmp_path / "grams", "--texts", tmp_path / "other.txt")
    assert again.returncode == 0, again.stderr
    assert "already measured" in again.stdout, again.stdout


def test_measure_plan_estimates_the_passes_writes_nothing_and_names_the_budget_measure_takes(tmp_path: Path) -> None:
    """No command estimated ``measure`` (issue 71, item 5): ``--plan`` gives each model's layers and memory and the
    smallest budget that fits, writes nothing, exits 2 below that budget; measure itself runs at it."""
    pytest.importorskip("transformers")
    config = _measured_config(tmp_path)
    out = tmp_path / "grams"
    planned = cli_here("measure", config, out, "--plan")
    assert planned.returncode == 0, planned.stderr
    lines = planned.stdout.splitlines()
    assert sum("decoder layer(s)" in line for line in lines) == 2 and lines[-1] == "fits", planned.stdout
    assert not out.exists()
    smallest = re.search(r"the smallest budget that fits is ([\d.]+ [kMG]?B)", planned.stdout)
    assert smallest, planned.stdout
    short = cli_here("measure", config, out, "--plan", "--max-memory", "1MB")
    assert short.returncode == 2 and "will not fit: rerun with --max-memory" in short.stdout, short.stdout
    named = re.search(r"rerun with --max-memory (\S+) or more", short.stdout)
    assert named and not out.exists()
    done = cli_here("measure", config, out, "--max-memory", named[1])
    assert done.returncode == 0, done.stderr
