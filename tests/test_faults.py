"""Fault injection: real merges in subprocesses meet the failures that disks, users and clocks really produce.

Each scenario injects one fault — ENOSPC or EIO on shard writes or on the ledger's own SQLite I/O (through the
LD_PRELOAD shim in tests/faultshim, so SQLite's C code fails too), a file size limit, OUT turning read-only or
unwritable, an input shard deleted or rewritten mid-run, a damaged ledger between runs, the wall clock jumping —
and requires: one clear error line and no traceback; exit 3 for storage faults (fix the disk, then resume) or 4
when resumerge refuses (an input changed, nothing to rebuild a damaged ledger from); every file committed before
the fault still byte-equal to the reference run's; and a later ``resumerge resume OUT`` without the fault ending
byte-identical to an uninterrupted run, with no temp file left behind.

Damaged ledgers (decision): a ledger that is not SQLite, fails SQLite's quick_check or has another schema is
never trusted. ``resume`` moves it aside (``ledger.db.damaged``) and rebuilds the ledger from OUT's manifest after
re-hashing every file the manifest lists, saying so; without a manifest it refuses with exit 4 and a hint.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from faultshim import ShimUnavailable, build_shim, probe_shim, shim_env
from support import ReferenceMerge, cli, cli_here, cli_start, digests, linear_config, reference_merge

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec
from resumerge.config.locations import StateDir, run_dir
from resumerge.merge.store.integrity import verify_output

SHARD = "100k"
YEAR = 365 * 24 * 3600


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> ReferenceMerge:
    spec = ModelSpec(layers=4, hidden=64, intermediate=128, vocab=200, shard_bytes=200_000)
    merge = reference_merge(tmp_path_factory.mktemp("faults"), spec, SHARD)
    assert sum(n.startswith("model-") for n in merge.reference) >= 6, "the scenarios need several output shards"
    return merge


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("shim")
    try:
        library = build_shim(directory)
        probe_shim(library, directory)
    except ShimUnavailable as exc:
        pytest.skip(str(exc))
    return library


def _run(setup: ReferenceMerge, out: Path, state: Path,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli("run", setup.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet", env=env)


def _one_error_line(done: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    """Assert exit ``code`` and exactly one stderr line, an ``error:`` line holding every fragment."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _committed(out: Path, state: Path) -> dict[str, str]:
    """name -> the checksum record of every file the ledger records as committed."""
    ledger = run_dir(out, state) / "ledger.db"
    conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT name, sha256 FROM files WHERE status = 'done'").fetchall())
    finally:
        conn.close()


def _assert_committed_kept(setup: ReferenceMerge, out: Path, state: Path, at_least: int) -> None:
    """Every committed file is intact and equal to the reference's; at least ``at_least`` shards were committed."""
    committed = _committed(out, state)
    shards = [n for n in committed if n.startswith("model-")]
    assert len(shards) >= at_least, committed
    now = digests(out)
    for name in committed:
        assert setup.reference[name] == now[name], name
    assert verify_output(out, StateDir.resolve(state)).ok  # each file against the ledger's record, by its algorithm


def _in_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The CLI run in this process, for the commands that only finish or inspect a scenario (no fault to inject):
    the same code and output as a subprocess, without its Python and torch start-up (about 3 s)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["resumerge", *map(str, args)], code, out.getvalue(), err.getvalue())


def _status(out: Path, state: Path) -> dict[str, object]:
    done = _in_process("status", out, "--state-dir", state, "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _resume_identical(setup: ReferenceMerge, out: Path, state: Path, env: dict[str, str] | None = None) -> str:
    # The shim's faults (env) live in a process of their own.
    done = _in_process("resume", out, "--state-dir", state) if env is None else \
        cli("resume", out, "--state-dir", state, env=env)
    assert done.returncode == 0, done.stderr
    assert digests(out) == setup.reference
    assert not [p.name for p in out.iterdir() if p.name.endswith(".part")]
    return done.stderr


# (id, shim settings with {out}/{state} placeholders, text the error line must hold, shards committed at least)
STORAGE_FAULTS: list[tuple[str, dict[str, object], str, int]] = [
    ("enospc-shard-write", {"match": "{out}/", "ops": "write", "errno": "ENOSPC", "skip_bytes": 250_000},
     "No space left on device", 2),
    ("eio-shard-write", {"match": "{out}/", "ops": "write", "errno": "EIO", "arm_renames": 3,
                         "arm_match": "{out}/model-"}, "Input/output error", 3),
    ("eio-fsync-in-out", {"match": "{out}/", "ops": "fsync", "errno": "EIO", "arm_renames": 2,
                          "arm_match": "{out}/model-"}, "Input/output error", 2),
    ("enospc-ledger-commit", {"match": "{state}/", "ops": "write", "errno": "ENOSPC", "arm_renames": 2,
                              "arm_match": "{out}/model-"}, "ledger could not be written", 1),
    ("eio-ledger-fsync", {"match": "{state}/", "ops": "fsync", "errno": "EIO", "arm_renames": 2,
                          "arm_match": "{out}/model-"}, "disk I/O error", 1),
    ("erofs-out-mid-run", {"match": "{out}/", "ops": "open,write,fsync,rename,unlink", "errno": "EROFS",
                           "arm_renames": 2, "arm_match": "{out}/model-"}, "Read-only file system", 2),
    ("eacces-out-mid-run", {"match": "{out}/", "ops": "open,rename,unlink", "errno": "EACCES", "arm_renames": 3,
                            "arm_match": "{out}/model-"}, "Permission denied", 3),
]


@pytest.mark.parametrize(("label", "settings", "fragment", "at_least"), STORAGE_FAULTS,
                         ids=[f[0] for f in STORAGE_FAULTS])
def test_storage_fault_exits_3_keeps_commits_and_resumes(setup: ReferenceMerge, shim: Path, label: str,
                                                         settings: dict[str, object], fragment: str,
                                                         at_least: int) -> None:
    out, state = setup.fresh(label)
    log = setup.root / f"{label}.log"
    log.unlink(missing_ok=True)
    values = {k: str(v).format(out=out, state=state) for k, v in settings.items()}
    failed = _run(setup, out, state, env=shim_env(shim, log=log, **values))
    line = _one_error_line(failed, 3, fragment)
    assert log.exists(), "the fault was never injected"
    assert "resume" in line
    if label == "enospc-shard-write":  # the command to run, not a word to fill in
        assert line.endswith(f"free disk space, then run resumerge resume {out} --state-dir {state}"), line
    _assert_committed_kept(setup, out, state, at_least)
    status = _status(out, state)
    assert status["state"] == "interrupted"
    if "{state}" not in str(settings["match"]):  # a failing ledger cannot record its own failure
        assert fragment in str(status["last_error"])
    stderr = _resume_identical(setup, out, state)
    assert "files were already committed" in stderr


@pytest.mark.parametrize(("shard", "limit", "fragment"), [
    ("1M", 400_000, "File too large"),  # the single ~700 kB shard crosses the limit
    (SHARD, 260_000, "file size limit of 260000 bytes"),  # the ledger's WAL outgrows it first (100 kB shards
    # cannot): SQLite says "I/O error". Above the ledger's size when the first manifest is written (its migrations,
    # plan and input contents leave a WAL of about 240 kB), so a manifest is written before it fails.
])
def test_file_size_limit_gives_efbig_not_sigxfsz(setup: ReferenceMerge, shard: str, limit: int, fragment: str) -> None:
    """RLIMIT_FSIZE: SIGXFSZ would kill the process (exit -25, no message, state left "running"); resumerge
    ignores it while merging, so the oversized write fails with EFBIG and the run stops with exit 3 and a hint
    naming ``ulimit -f``."""
    out, state = setup.fresh(f"fsize-{shard}")
    # The limit is set in the command's process before it starts (forked, it runs the CLI after setting it).
    done = cli("run", setup.config, out, "--state-dir", state, "--out-shard-size", shard, "--quiet",
               limits={"RLIMIT_FSIZE": limit})
    _one_error_line(done, 3, fragment, "ulimit -f")
    assert verify_output(out, StateDir.resolve(state)).ok
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    if shard == SHARD:
        assert digests(out) == setup.reference
    else:
        ref = setup.root / "reference-1M"
        assert main(["run", str(setup.config), str(ref), "--state-dir", str(setup.root / "ref-1M-state"),
                     "--out-shard-size", shard, "--quiet"]) == 0
        assert digests(out) == digests(ref)


def _paused_run(setup: ReferenceMerge, shim: Path, out: Path, state: Path, after_shards: int,
                meddle: Callable[[], None]) -> subprocess.CompletedProcess[str]:
    """Run the merge, pause its writer right after shard ``after_shards`` is published, call ``meddle``, go on."""
    flag = setup.root / f"pause-{out.name}"
    flag.unlink(missing_ok=True)
    env = shim_env(shim, arm_renames=after_shards, arm_match=f"{out}/model-", pause_flag=flag)
    # Under the shim: forked from the worker's fork server started under it, which each child makes read its settings
    proc = cli_start("run", setup.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet", env=env,
                     capture=True)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the merge never reached the pause"
        time.sleep(0.01)
    meddle()
    flag.unlink()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout or "", stderr or "")


def _input_shards(setup: ReferenceMerge) -> list[Path]:
    return sorted(setup.a.glob("model-*.safetensors"))


def test_input_shard_deleted_mid_run_is_refused_then_resumes(setup: ReferenceMerge, shim: Path) -> None:
    out, state = setup.fresh("input-deleted")
    victim = _input_shards(setup)[-1]
    saved = victim.read_bytes()
    try:
        done = _paused_run(setup, shim, out, state, 2, victim.unlink)
        _one_error_line(done, 4, str(victim), "was deleted during the merge")
    finally:
        victim.write_bytes(saved)
    _assert_committed_kept(setup, out, state, 1)
    _resume_identical(setup, out, state)


def test_input_shard_rewritten_mid_run_is_refused_then_resumes(setup: ReferenceMerge, shim: Path) -> None:
    """An input changed in place mid-run must not leak into committed shards: the run stops with exit 4 before
    committing anything computed after the change, a resume with the input still changed is refused, and once
    the input is restored the resume ends byte-identical."""
    out, state = setup.fresh("input-changed")
    victim = _input_shards(setup)[0]
    saved = victim.read_bytes()

    def rewrite() -> None:
        with open(victim, "r+b") as f:  # same size, same header, different weights: only the contents change
            f.seek(len(saved) - 4096)
            f.write(bytes(random.Random(0).randrange(256) for _ in range(4096)))

    try:
        done = _paused_run(setup, shim, out, state, 2, rewrite)
        _one_error_line(done, 4, str(victim), "changed during the merge")
        _assert_committed_kept(setup, out, state, 1)
        refused = _in_process("resume", out, "--state-dir", state, "--quiet")
        _one_error_line(refused, 4, "planned differently")
    finally:
        victim.write_bytes(saved)
    _resume_identical(setup, out, state)


@pytest.fixture(scope="module")
def interrupted(setup: ReferenceMerge) -> tuple[Path, Path]:
    """OUT and state dir of a run SIGKILLed after its 3rd manifest write, WAL checkpointed into ledger.db."""
    out, state = setup.killed("interrupted", "after_manifest_write:3", SHARD)
    conn = sqlite3.connect(run_dir(out, state) / "ledger.db")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return out, state


def _copy_interrupted(setup: ReferenceMerge, interrupted: tuple[Path, Path], name: str) -> tuple[Path, Path, Path]:
    out, state = setup.fresh(name)
    shutil.copytree(interrupted[0], out)
    ledger = run_dir(out, state) / "ledger.db"
    ledger.parent.mkdir(parents=True)
    shutil.copyfile(run_dir(*interrupted) / "ledger.db", ledger)
    return out, state, ledger


def _wrong_schema(path: Path) -> None:
    path.unlink()
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE run (id INTEGER PRIMARY KEY, notes TEXT)")
    conn.execute("INSERT INTO run VALUES (1, 'not a resumerge ledger')")
    conn.commit()
    conn.close()


def _overwrite(path: Path, offset: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(random.Random(7).randbytes(length))


LEDGER_DAMAGE: list[tuple[str, Callable[[Path], object]]] = [
    ("deleted", lambda p: p.unlink()),
    ("empty", lambda p: p.write_bytes(b"")),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
    ("header-overwritten", lambda p: _overwrite(p, 0, 100)),
    ("pages-overwritten", lambda p: _overwrite(p, 4096, 8192)),
    ("wrong-schema", _wrong_schema),
]


def test_status_and_verify_fall_back_to_the_manifest_when_the_ledger_is_damaged(
        setup: ReferenceMerge, interrupted: tuple[Path, Path]) -> None:
    out, state, ledger = _copy_interrupted(setup, interrupted, "ledger-status")
    _overwrite(ledger, 0, 100)
    status = cli_here("status", out, "--state-dir", state, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["source"] == "manifest"
    check = cli_here("verify", out, "--state-dir", state, "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["ok"] and json.loads(check.stdout)["checked"] >= 3


@pytest.mark.parametrize(("label", "damage"), LEDGER_DAMAGE, ids=[d[0] for d in LEDGER_DAMAGE])
def test_damaged_ledger_is_set_aside_and_rebuilt_from_out(setup: ReferenceMerge, interrupted: tuple[Path, Path],
                                                          label: str, damage: Callable[[Path], object]) -> None:
    out, state, ledger = _copy_interrupted(setup, interrupted, f"ledger-{label}")
    damage(ledger)
    stderr = _resume_identical(setup, out, state)
    assert "ledger rebuilt from resumerge-manifest.json" in stderr
    if label not in ("deleted", "empty"):  # SQLite takes an empty file for a new database: nothing to distrust
        assert "set aside as ledger.db.damaged" in stderr
        assert ledger.with_name("ledger.db.damaged").exists()
    assert verify_output(out, StateDir.resolve(state)).ok


def test_damaged_ledger_without_manifest_is_refused_with_hint(setup: ReferenceMerge,
                                                              interrupted: tuple[Path, Path]) -> None:
    out, state, ledger = _copy_interrupted(setup, interrupted, "ledger-no-manifest")
    (out / "resumerge-manifest.json").unlink()
    _overwrite(ledger, 0, 100)
    refused = _in_process("resume", out, "--state-dir", state, "--quiet")
    _one_error_line(refused, 4, "damaged", "--restart")
    assert ledger.exists() and not ledger.with_name("ledger.db.damaged").exists()


def test_clock_jumps_change_nothing(setup: ReferenceMerge, shim: Path) -> None:
    """The wall clock jumps back ten years mid-run, then the resume runs three years in the future: output bytes
    never depend on the time, and status reports no negative durations."""
    out, state = setup.fresh("clock")
    back = shim_env(shim, clock_shift=-10 * YEAR, arm_renames=2, arm_match=f"{out}/model-")
    killed = _run(setup, out, state, env={**back, "RESUMERGE_KILL_AT": "after_manifest_write:4"})
    assert killed.returncode == -9, killed.stderr
    _assert_committed_kept(setup, out, state, 3)
    forward = shim_env(shim, clock_shift=3 * YEAR)
    _resume_identical(setup, out, state, env=forward)
    status = _status(out, state)
    assert status["state"] == "done" and float(str(status["elapsed_seconds"])) >= 0


def test_a_ledger_of_the_previous_schema_is_migrated_and_resumes(setup: ReferenceMerge,
                                                                 interrupted: tuple[Path, Path]) -> None:
    """A ledger written before migration m003 (``tensors`` still with its never-filled ``crc32`` and ``seconds``)
    opens, loses the two columns and resumes to the reference bytes, trusting the files it recorded."""
    from sqlite_utils import Database

    from resumerge.merge.store.ledger import migrations

    out, state, ledger = _copy_interrupted(setup, interrupted, "ledger-previous-schema")
    current = ledger.with_name("current.db")
    ledger.rename(current)
    old = Database(ledger)
    migrations.apply(old, stop_before="m003_drop_unfilled_tensor_columns")  # the schema as released before m003
    old.execute("ATTACH DATABASE ? AS cur", [str(current)])
    for table in ("run", "files", "tensors", "events", "stream_reads"):
        names = [d[0] for d in old.execute(f"SELECT * FROM cur.[{table}] LIMIT 0").description
                 if d[0] in old[table].columns_dict]  # a later migration's columns (run.kind) were not there yet
        columns = ", ".join(f"[{c}]" for c in names)
        old.execute(f"INSERT INTO main.[{table}] ({columns}) SELECT {columns} FROM cur.[{table}]")
    old.conn.commit()
    old.execute("DETACH DATABASE cur")
    assert {"crc32", "seconds"} <= set(old["tensors"].columns_dict)
    committed = dict(old.execute("SELECT name, sha256 FROM files WHERE status = 'done'").fetchall())
    assert sum(n.startswith("model-") for n in committed) >= 2
    old.close()
    current.unlink()

    stderr = _resume_identical(setup, out, state)
    assert "files were already committed" in stderr and "set aside" not in stderr
    assert not ledger.with_name("ledger.db.damaged").exists()
    migrated = sqlite3.connect(ledger)
    try:
        columns = {row[1] for row in migrated.execute("PRAGMA table_info(tensors)")}
        applied = {row[0] for row in migrated.execute("SELECT name FROM _sqlite_migrations")}
    finally:
        migrated.close()
    assert columns == {"name", "shard", "status", "bytes"}
    assert "m003_drop_unfilled_tensor_columns" in applied


# A recipe over the two models: a named stage, then the final merge reading it.
def _recipe(setup: ReferenceMerge) -> Path:
    a, b = str(setup.a), str(setup.root / "b")
    first = linear_config(Path(a), Path(b), weights=(0.5, 0.5))
    final = {"merge_method": "linear", "models": [{"model": "first", "parameters": {"weight": 0.7}},
                                                  {"model": a, "parameters": {"weight": 0.3}}]}
    docs = [{"name": "first", **first}, final]
    path = setup.root / "recipe.yml"
    path.write_text("---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs))
    return path


def _weights(directory: Path) -> dict[str, str]:
    return {k: v for k, v in digests(directory).items() if k.endswith((".safetensors", ".json")) and
            not k.startswith("resumerge-")}


@pytest.fixture(scope="module")
def recipe_reference(setup: ReferenceMerge) -> dict[str, str]:
    """The weight files of an uninterrupted run of :func:`_recipe`."""
    out, state = setup.fresh("recipe-reference")
    assert main(["run", str(_recipe(setup)), str(out), "--state-dir", str(state), "--out-shard-size", SHARD,
                 "--quiet"]) == 0
    return _weights(out)


# (id, shim settings): the whole state dir's disk fills (a stage's ledger fails first, then the recipe ledger
# cannot record why), or only the recipe ledger's writes fail (after the named stage published two shards).
RECIPE_STORAGE_FAULTS: list[tuple[str, dict[str, object]]] = [
    ("enospc-state-dir", {"match": "{state}/", "ops": "write", "errno": "ENOSPC", "arm_renames": 2,
                          "arm_match": "{out}/model-"}),
    ("enospc-recipe-ledger", {"match": "{state}/recipe-", "ops": "write", "errno": "ENOSPC", "arm_renames": 2,
                              "arm_match": "/first/model-"}),
]


@pytest.mark.parametrize(("label", "settings"), RECIPE_STORAGE_FAULTS, ids=[f[0] for f in RECIPE_STORAGE_FAULTS])
def test_a_full_disk_during_a_recipe_exits_3_and_resumes(setup: ReferenceMerge, shim: Path,
                                                         recipe_reference: dict[str, str], label: str,
                                                         settings: dict[str, object]) -> None:
    """A recipe meets a full state dir as a single merge does: exit 3 and one line naming the ledger that could
    not be written (never an internal error, never "delete the ledger"); the resume ends identical."""
    out, state = setup.fresh(label)
    shutil.rmtree(setup.root / f"out-{label}.intermediates", ignore_errors=True)
    log = setup.root / f"{label}.log"
    log.unlink(missing_ok=True)
    values = {k: str(v).format(out=out, state=state) for k, v in settings.items()}
    failed = cli("run", _recipe(setup), out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet",
                 env=shim_env(shim, log=log, **values))
    line = _one_error_line(failed, 3, "ledger could not be written", "disk is full")
    assert log.exists(), "the fault was never injected"
    assert "resume" in line
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert _weights(out) == recipe_reference
    assert main(["verify", str(out), "--state-dir", str(state)]) == 0


def test_a_damaged_recipe_ledger_is_set_aside_and_the_recipe_resumes(setup: ReferenceMerge,
                                                                      recipe_reference: dict[str, str]) -> None:
    out, state = setup.fresh("recipe-ledger-damaged")
    shutil.rmtree(setup.root / "out-recipe-ledger-damaged.intermediates", ignore_errors=True)
    killed = cli("run", _recipe(setup), out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:3"})
    assert killed.returncode == -9, killed.stderr
    ledgers = list(state.glob("recipe-*/recipe.db"))
    assert len(ledgers) == 1
    ledger = ledgers[0]
    conn = sqlite3.connect(ledger)  # the killed run's WAL into the file, so the damage is not read around
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    _overwrite(ledger, 0, 100)
    assert _status(out, state)["source"] == "manifest"
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert _weights(out) == recipe_reference
    assert ledger.with_name("recipe.db.damaged").exists()
    status = _status(out, state)
    assert status["state"] == "done" and status["source"] == "ledger"
    events = status["events"]
    assert isinstance(events, list) and any("set aside as recipe.db.damaged" in e for e in events)
