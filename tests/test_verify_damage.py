"""``verify`` on the damage it exists to find (issue 60, item 3), and the messages around a damaged or missing OUT
(item 10).

Every kind of output file of a finished merge — shards, index, config.json, tokenizer files, the card, the
merge's config and the manifest — is flipped, truncated, deleted and overwritten with non-UTF-8 bytes; ``verify``
must exit 3 naming that file (never 1: it once parsed config.json before comparing its checksum, and never looked
at the manifest), and ``resume`` must make the output byte-identical again. One merge is made per module and
copied, with its ledger, for each case (the ledger's place follows OUT's path).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from support import DAMAGE, ReferenceMerge, digests, flip_byte, reference_merge

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec
from resumerge.config.locations import run_dir
from resumerge.errors import EXIT_INTERRUPTED, EXIT_REFUSED
from resumerge.merge.store.manifest import MANIFEST_NAME

SHARD = "100k"


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> ReferenceMerge:
    return reference_merge(tmp_path_factory.mktemp("verify-damage"), ModelSpec(shard_bytes=60_000), SHARD)


def _copy(ref: ReferenceMerge, name: str, *, ledger: bool = True) -> tuple[Path, Path]:
    """A copy of the finished output at ``root/name``, with its ledger (unless ``ledger`` is false: a fresh
    machine, or the state dir lost)."""
    out, state = ref.root / name, ref.root / f"{name}-state"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    shutil.copytree(ref.out, out)
    if ledger:
        shutil.copytree(run_dir(ref.out, ref.state), run_dir(out, state))
    return out, state


# Every kind of file the merge writes (the test below checks that this is every file it wrote).
FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
         "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "README.md",
         "mergekit_config.yml", MANIFEST_NAME)


def _verify(out: Path, state: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main(["verify", str(out), "--state-dir", str(state), "--json"])
    printed = capsys.readouterr().out
    return code, (json.loads(printed) if printed.strip() else {})


def test_the_fuzzed_files_are_every_file_the_merge_writes(ref: ReferenceMerge) -> None:
    assert sorted(ref.reference) == sorted(FILES)


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_verify_names_each_damaged_file_and_resume_repairs_it(
        ref: ReferenceMerge, name: str, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    """config.json with a non-UTF-8 byte: "internal error: UnicodeDecodeError", exit 1; a damaged manifest: "ok"
    (while resume and run refused the folder as "not written by this resumerge")."""
    out, state = _copy(ref, f"{name}-{damage}")
    DAMAGE[damage](out / name)
    code, report = _verify(out, state, capsys)
    assert code == EXIT_INTERRUPTED, report
    assert [d["name"] for d in report["damaged"]] == [name]
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == ref.reference
    assert _verify(out, state, capsys)[0] == 0


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", [n for n in FILES if n != MANIFEST_NAME])
def test_without_the_ledger_verify_names_the_damaged_file_from_the_manifest(
        ref: ReferenceMerge, name: str, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    out, state = _copy(ref, f"bare-{name}-{damage}", ledger=False)
    DAMAGE[damage](out / name)
    code, report = _verify(out, state, capsys)
    assert code == EXIT_INTERRUPTED, report
    assert [d["name"] for d in report["damaged"]] == [name]


@pytest.mark.parametrize("damage", ["truncated", "non-utf8"])
def test_without_the_ledger_a_damaged_manifest_is_refused_as_untrustworthy(
        ref: ReferenceMerge, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The manifest is then the only record of the run: nothing in OUT can be checked, and the line says so and
    what to do — never a traceback, never "ok"."""
    out, state = _copy(ref, f"bare-manifest-{damage}", ledger=False)
    DAMAGE[damage](out / MANIFEST_NAME)
    capsys.readouterr()
    code = main(["verify", str(out), "--state-dir", str(state)])
    err = capsys.readouterr().err
    assert code == EXIT_REFUSED
    assert MANIFEST_NAME in err and "is damaged" in err and "--state-dir" in err
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == EXIT_REFUSED


@pytest.mark.parametrize("command", ["run", "resume"])
def test_a_damaged_manifest_is_rewritten_by_run_and_resume_from_the_ledger(
        ref: ReferenceMerge, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Both refused the complete merge: "the manifest … is unreadable — it was not written by this resumerge"."""
    out, state = _copy(ref, f"manifest-{command}")
    (out / MANIFEST_NAME).write_bytes(b"garbage\n")
    args = ["run", str(ref.config), str(out), "--out-shard-size", SHARD] if command == "run" else ["resume", str(out)]
    assert main([*args, "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == ref.reference


def test_a_foreign_folder_with_a_manifest_name_is_still_refused(ref: ReferenceMerge) -> None:
    """The ledger vouches only for the folder whose committed files it holds: a damaged manifest beside files of
    another tool, with no ledger of a run there, is refused and nothing is touched."""
    out = ref.root / "foreign"
    out.mkdir()
    (out / MANIFEST_NAME).write_bytes(b"\xff\xfe")
    (out / "config.json").write_text("{}")
    assert main(["run", str(ref.config), str(out), "--state-dir", str(ref.root / "foreign-state"), "--quiet"]) == 4
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MANIFEST_NAME]


def test_an_unfinished_runs_manifest_is_not_called_damaged(
        ref: ReferenceMerge, capsys: pytest.CaptureFixture[str]) -> None:
    """Killed between a file's ledger row and the manifest write that lists it, the manifest lacks that file: the
    state every kill leaves, which resume finishes — not damage."""
    out, state = ref.killed("killed", "after_ledger_commit:1", SHARD)
    code, report = _verify(out, state, capsys)
    assert code == 0 and report["pending"], report


def test_verify_of_a_missing_out_says_what_resume_and_status_say(
        ref: ReferenceMerge, capsys: pytest.CaptureFixture[str]) -> None:
    """verify listed every file as "missing" and said "repair with: resumerge resume OUT", which then refused:
    "OUT does not exist … may have moved"."""
    out, state = _copy(ref, "moved")
    shutil.rmtree(out)
    lines = []
    for command in ("verify", "resume", "status"):
        capsys.readouterr()
        assert main([command, str(out), "--state-dir", str(state)]) == EXIT_REFUSED, command
        lines.append(capsys.readouterr().err.strip())
    assert len(set(lines)) == 1 and "does not exist, though 9 file(s) were committed there" in lines[0], lines


def test_a_rerun_into_a_deleted_out_starts_afresh_in_one_line(
        ref: ReferenceMerge, capsys: pytest.CaptureFixture[str]) -> None:
    """It printed "missing: rebuilding it" once per file, and status then showed the old run's time and peak."""
    out, state = _copy(ref, "deleted")
    with sqlite3.connect(run_dir(out, state) / "ledger.db") as db:  # an old run of a day, with a huge peak
        db.execute("UPDATE run SET created_at = ?, peak_rss = ?", (time.time() - 86400, 10**15))
    shutil.rmtree(out)
    capsys.readouterr()
    assert main(["run", str(ref.config), str(out), "--state-dir", str(state), "--out-shard-size", SHARD]) == 0
    err = capsys.readouterr().err
    assert "rebuilding it" not in err
    assert err.count("OUT holds none of the 9 files an earlier run of this merge committed there") == 1, err
    assert digests(out) == ref.reference
    assert main(["status", str(out), "--state-dir", str(state), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["peak_rss"] < 10**15 and status["elapsed_seconds"] < 3600, status


def test_verify_s_repair_hint_keeps_the_state_dir_the_run_used(
        ref: ReferenceMerge, capsys: pytest.CaptureFixture[str]) -> None:
    """The hint said "repair with: resumerge resume OUT" without the run's --state-dir: that resume found no ledger
    in the default state dir. It is the same command resume_command gives every other message."""
    out, state = _copy(ref, "hint-state-dir")
    flip_byte(out / "config.json")
    capsys.readouterr()
    assert main(["verify", str(out), "--state-dir", str(state)]) == EXIT_INTERRUPTED
    printed = "".join(capsys.readouterr().out.split())  # rich may wrap a long line anywhere
    assert "".join(f"repair with: resumerge resume {out} --state-dir {state}".split()) in printed, printed
