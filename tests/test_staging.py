"""Drive-safe output: files are written on local staging and published to OUT by copy + read-back verify."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import StorageError
from resumerge.machine.durable import publish_copy
from resumerge.machine.filesystems import filesystem_type, needs_staging, parse_mountinfo
from resumerge.machine.killpoints import STAGED_POINTS
from tests.support import cli, digests, linear_config, write_config

COLAB = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 0:31 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u
85 27 0:52 / /content/drive rw,nosuid,nodev,relatime - fuse.drive drive rw,user_id=0
86 27 8:1 / /content/my\\040disk rw,relatime - ext4 /dev/sda1 rw
90 27 0:60 / /mnt/share rw,relatime - nfs4 server:/export rw
"""


def test_mountinfo_types_and_escapes() -> None:
    mounts = {m.point: m.fstype for m in parse_mountinfo(COLAB + "garbage line\n")}
    assert mounts == {"/proc": "proc", "/": "overlay", "/content/drive": "fuse.drive",
                      "/content/my disk": "ext4", "/mnt/share": "nfs4"}


@pytest.mark.parametrize(("path", "fstype", "staged"), [
    ("/content/drive/MyDrive/out", "fuse.drive", True),
    ("/content/drive", "fuse.drive", True),
    ("/content/drive2/out", "overlay", False),  # a sibling name is not under the mount
    ("/content/my disk/out", "ext4", False),
    ("/mnt/share/x", "nfs4", True),
    ("/content/out", "overlay", False),
])
def test_which_outputs_are_staged(path: str, fstype: str, staged: bool) -> None:
    assert filesystem_type(Path(path), COLAB) == fstype
    assert needs_staging(Path(path), COLAB) is staged


def test_a_copy_that_reads_back_differently_is_never_published(tmp_path: Path) -> None:
    staged, final = tmp_path / "staged.bin", tmp_path / "out" / "model.safetensors"
    final.parent.mkdir()
    staged.write_bytes(b"x" * 1000)
    with pytest.raises(StorageError, match="differs from what was written"):
        publish_copy(staged, final, "0" * 64)
    assert list(final.parent.iterdir()) == []  # neither the final name nor a temp copy
    assert staged.exists()  # the good local copy is kept for the next try


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The config and the reference output's digests, made once: no test writes into the models or the config.
    The reference runs the CLI in this process (one start-up fewer); the runs compared with it are subprocesses."""
    root = tmp_path_factory.mktemp("staging-merge")
    spec = ModelSpec(hidden=32, intermediate=64, vocab=128, layers=4)
    a, b = make_model(root / "a", spec, seed=1), make_model(root / "b", spec, seed=2)
    config = write_config(root / "c.yml", linear_config(a, b))
    ref = root / "ref"
    assert main(["run", str(config), str(ref), "--out-shard-size", "40k", "--state-dir", str(root / "ref-state"),
                 "--quiet"]) == 0
    return config, digests(ref)


def test_staged_run_equals_a_direct_one_and_leaves_staging_empty(tmp_path: Path,
                                                                 merge: tuple[Path, dict[str, str]]) -> None:
    config, reference = merge
    out, staging = tmp_path / "out", tmp_path / "staging"
    done = cli("run", config, out, "--out-shard-size", "40k", "--staging-dir", staging)
    assert done.returncode == 0, done.stderr
    assert "publishing to OUT by copy + verify" in done.stderr
    assert digests(out) == reference
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("point", ["after_temp_write:2", "after_fsync:2", *(f"{p}:2" for p in STAGED_POINTS),
                                   "after_rename:2", "after_ledger_commit:3", "during_config_write:1"])
def test_staged_kill_points_resume_identically(tmp_path: Path, merge: tuple[Path, dict[str, str]],
                                              point: str) -> None:
    config, reference = merge
    out, staging, state = tmp_path / "out", tmp_path / "staging", tmp_path / "state"
    args = ("--staging-dir", staging, "--state-dir", state, "--quiet")
    killed = cli("run", config, out, "--out-shard-size", "40k", *args, env={"RESUMERGE_KILL_AT": point})
    assert killed.returncode == -signal.SIGKILL, f"{point} was never reached: {killed.stderr}"
    # The kill needs a real process; the resume runs the same CLI in this one.
    assert main(["resume", *map(str, (out, *args))]) == 0
    assert digests(out) == reference
    assert list(staging.iterdir()) == []


def test_a_published_file_damaged_later_is_rewritten_on_resume(tmp_path: Path, merge: tuple[Path, dict[str, str]],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A half-synced Drive file is never taken as committed: resume re-verifies every published file."""
    config, reference = merge
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["run", str(config), str(out), "--out-shard-size", "40k", "--state-dir", str(state), "--staging-dir",
                 str(tmp_path / "st"), "--quiet"]) == 0
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capsys.readouterr()
    assert main(["resume", str(out), "--state-dir", str(state), "--staging-dir", str(tmp_path / "st")]) == 0
    assert shard.name in capsys.readouterr().err
    assert digests(out) == reference


def test_staging_inside_out_is_refused(tmp_path: Path, merge: tuple[Path, dict[str, str]],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = merge
    out = tmp_path / "out"
    assert main(["run", str(config), str(out), "--staging-dir", str(out / "stage")]) == 2
    assert "inside OUT" in capsys.readouterr().err
