"""What a run records of the files it is given by path (issue 95: "the manifest records what determines the
bytes, never a machine path"): ``--imatrix FILE`` and ``--imatrix-texts FILE`` are recorded in OUT's manifest (and
fingerprinted) by the digest of their bytes and their base name, so two runs of the same files from other folders
write the same manifest and no machine path is published; the state dir's ledger keeps where this machine read
them, so ``resume OUT`` finds them after a kill, and refuses (exit 4) a file whose bytes changed or one it cannot
find (naming it by base name and digest, and how to give it again)."""

from __future__ import annotations

import hashlib
import shutil
import signal
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggufmodels import linear_llama_pair
from support import cli

from resumerge.merge.store.manifest import MANIFEST_NAME

TEXTS = "the cat sat on the mat.\nthree plus four is seven.\nabc def ghi 123 456\n"
K_MIX = ("--out-type", "gguf", "--gguf-type", "q4_k_m")


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float16 linear merge of two tiny llama GGUFs (its config) and calibration texts the vocabulary spells."""
    return linear_llama_pair(tmp_path_factory.mktemp("paths"), TEXTS)


def _matrix(config: Path, path: Path, scale: float = 1.0) -> Path:
    """An importance matrix (llama-imatrix's GGUF) with an entry for each decoder weight of the merge's inputs."""
    from resumerge.forward.sums.imatrix import imatrix_file
    from resumerge.outputs.gguf.imatrix import ImatrixEntry

    reader = gguf.GGUFReader(config.parent / "a.gguf")
    entries = {t.name: ImatrixEntry(np.linspace(1, 2 * scale, int(t.shape[0]), dtype=np.float32)[None, :],
                                    np.array([1], np.float32))
               for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(imatrix_file(entries, "texts.txt", 1))
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("flag", ["--imatrix", "--imatrix-texts"])
def test_two_runs_of_copies_in_other_folders_write_the_same_manifest_and_no_path(
        merge: tuple[Path, Path], tmp_path: Path, flag: str) -> None:
    config, texts = merge
    given = []
    for folder in ("one", "two"):
        where = tmp_path / folder / ("m.gguf" if flag == "--imatrix" else "texts.txt")
        if flag == "--imatrix":
            _matrix(config, where)
        else:
            where.parent.mkdir()
            shutil.copyfile(texts, where)
        given.append(where)
        done = cli("run", config, tmp_path / folder / "out", "--state-dir", tmp_path / folder / "s", *K_MIX,
                   flag, where)
        assert done.returncode == 0, done.stderr
    one, two = ((tmp_path / f / "out" / MANIFEST_NAME).read_text() for f in ("one", "two"))
    assert one == two
    assert str(tmp_path) not in one and str(given[0].parent) not in one
    assert given[0].name in one and _sha(given[0]) in one
    assert _sha(tmp_path / "one" / "out" / "model.gguf") == _sha(tmp_path / "two" / "out" / "model.gguf")


def test_a_killed_run_with_imatrix_resumes_and_a_changed_or_missing_matrix_is_refused(
        merge: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed (SIGKILL) mid-write, ``resume OUT`` finds the matrix where the ledger says and finishes the bytes of a
    run never killed; a matrix whose bytes changed, or gone, is refused (exit 4) in a line; given again (a copy from
    another folder), the run continues to the same bytes."""
    config, _ = merge
    matrix = _matrix(config, tmp_path / "m" / "m.gguf")
    whole = tmp_path / "whole"
    done = cli("run", config, whole, "--state-dir", tmp_path / "sw", *K_MIX, "--imatrix", matrix)
    assert done.returncode == 0, done.stderr
    args = ("--out-shard-size", "100KB")
    for n, then in enumerate(("same", "changed", "moved")):
        out, state = tmp_path / f"out{n}", tmp_path / f"s{n}"
        _matrix(config, matrix)
        killed = cli("run", config, out, "--state-dir", state, *K_MIX, "--imatrix", matrix, *args,
                     env={"RESUMERGE_KILL_AT": "after_unit_commit:2"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert str(matrix.parent) not in (out / MANIFEST_NAME).read_text()
        if then == "changed":
            _matrix(config, matrix, scale=3.0)
        if then == "moved":
            matrix.rename(tmp_path / "m" / "elsewhere.gguf")
        resumed = cli("resume", out, "--state-dir", state)
        if then == "same":
            assert resumed.returncode == 0, resumed.stderr
            assert _sha(out / "model.gguf") == _sha(whole / "model.gguf")
            continue
        assert resumed.returncode == 4, resumed.stderr
        assert "Traceback" not in resumed.stderr and len(resumed.stderr.strip().splitlines()) <= 2, resumed.stderr
        said = "bytes changed" if then == "changed" else "is gone"
        assert said in resumed.stderr, resumed.stderr
        if then == "moved":  # given again, from its new place: the run continues to the same bytes
            matrix = (tmp_path / "m" / "elsewhere.gguf").rename(tmp_path / "m" / "m.gguf")
            (tmp_path / "other").mkdir()
            copy = shutil.copyfile(matrix, tmp_path / "other" / "m.gguf")
            again = cli("run", config, out, "--state-dir", state, *K_MIX, "--imatrix", copy, *args)
            assert again.returncode == 0, again.stderr
            assert _sha(out / "model.gguf") == _sha(whole / "model.gguf")


def test_a_run_given_texts_resumes_on_a_machine_that_never_saw_them_only_when_given_again(
        merge: tuple[Path, Path], tmp_path: Path) -> None:
    """OUT's manifest alone (a fresh state dir, as on another machine): resume names the texts file by base name and
    digest and says how to give it; run with the texts from another folder continues the run."""
    config, texts = merge
    out = tmp_path / "out"
    killed = cli("run", config, out, "--state-dir", tmp_path / "s", *K_MIX, "--imatrix-texts", texts,
                 "--out-shard-size", "100KB", env={"RESUMERGE_KILL_AT": "after_unit_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    refused = cli("resume", out, "--state-dir", tmp_path / "fresh")
    assert refused.returncode == 4, refused.stderr
    assert texts.name in refused.stderr and _sha(texts) in refused.stderr and "--imatrix-texts FILE" in refused.stderr
    assert str(texts.parent) not in refused.stderr
    copy = tmp_path / "copy" / texts.name
    copy.parent.mkdir()
    shutil.copyfile(texts, copy)
    again = cli("run", config, out, "--state-dir", tmp_path / "fresh", *K_MIX, "--imatrix-texts", copy,
                "--out-shard-size", "100KB")
    assert again.returncode == 0, again.stderr


def test_a_run_recorded_by_path_before_the_digests_is_refused_in_one_line(
        merge: tuple[Path, Path], tmp_path: Path) -> None:
    """A run an earlier resumerge recorded with the texts' absolute path and no digest (its ledger's options as it
    wrote them): ``resume`` refuses it (exit 4, the plan is not today's), never a traceback."""
    import json
    import sqlite3

    from resumerge.config.locations import StateDir

    config, texts = merge
    out, state = tmp_path / "out", tmp_path / "s"
    killed = cli("run", config, out, "--state-dir", state, *K_MIX, "--imatrix-texts", texts,
                 "--out-shard-size", "100KB", env={"RESUMERGE_KILL_AT": "after_unit_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with sqlite3.connect(StateDir.resolve(state).run(out).ledger) as db:
        (options,) = db.execute("SELECT options FROM run").fetchone()
        older = {k: v for k, v in json.loads(options).items() if not k.endswith("_sha256")}
        db.execute("UPDATE run SET options = ?", (json.dumps({**older, "imatrix_texts": str(texts)}),))
    refused = cli("resume", out, "--state-dir", state)
    assert refused.returncode == 4, refused.stderr
    assert "earlier resumerge" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
