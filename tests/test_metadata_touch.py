"""A metadata-only change to an input is no change of its content (issue 97, item 1): a chmod, a chown, a new hard
link or an xattr moves a file's ctime and leaves its bytes as they were, so a read that saw only the ctime move is
taken again and trusted where it agrees; a write (even one whose mtime was set back, which only the ctime shows) is
still refused."""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash
from support import cli, linear_config, write_config

from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import PlanChangedError
from resumerge.inputs.contents import record_contents
from resumerge.inputs.looks import hash_spans
from resumerge.inputs.readdigests import ReadDigests


def _chmod(path: Path) -> None:
    """A new ctime, the same bytes and mtime."""
    path.chmod(path.stat().st_mode ^ 0o040)


class _Meddling:
    """A digest that calls ``meddle`` once, on its first update: something done to the file while it is read."""

    def __init__(self, meddle: Callable[[], None]) -> None:
        self.inner = xxhash.xxh3_128()
        self.meddle: Callable[[], None] | None = meddle

    def update(self, data: memoryview, /) -> None:
        self.inner.update(data)
        if self.meddle is not None:
            meddle, self.meddle = self.meddle, None
            meddle()

    def copy(self) -> _Meddling:
        twin = _Meddling(lambda: None)
        twin.inner, twin.meddle = self.inner.copy(), None
        return twin

    def digest(self) -> bytes:
        return self.inner.digest()


@pytest.fixture
def weights(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    path = tmp_path / "model.safetensors"
    data = random.Random(5).randbytes(1 << 20)
    path.write_bytes(data)
    yield path, data


def _write_mtime_kept(path: Path, at: int) -> None:
    """Change one byte and set the mtime back: only the ctime shows the write."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_chmod_while_a_file_is_hashed_is_no_change(weights: tuple[Path, bytes]) -> None:
    path, data = weights
    digest = _Meddling(lambda: _chmod(path))
    look, untrusted = hash_spans(path, [(((0, len(data)),), digest)], lambda: PlanChangedError("changed"))
    assert digest.digest() == xxhash.xxh3_128_digest(data)
    assert untrusted and look[0] == len(data)  # the look taken is never trusted: the file is hashed again next time


def test_a_chmod_between_a_run_s_reads_and_its_proof_is_no_change(weights: tuple[Path, bytes]) -> None:
    """The merge's reads hash ranges long before the proof's last look: a chmod meanwhile is proved by the ranges
    hashed again, and the look recorded is one no later stat matches."""
    path, _ = weights
    ranges = ((0, 1000), (1000, 300_000), (300_000, 1 << 20))
    reads = ReadDigests({str(path): ranges})
    _chmod(path)
    found = record_contents([path], None, reads=reads)
    assert found[str(path)].ctime_ns == -1
    assert found[str(path)].digest == record_contents([path], None, reads=ReadDigests({str(path): ranges}))[
        str(path)].digest


def test_a_write_whose_mtime_was_set_back_while_a_file_is_hashed_is_refused(weights: tuple[Path, bytes]) -> None:
    path, data = weights
    digest = _Meddling(lambda: _write_mtime_kept(path, 12))  # a range read already: only a second read sees it
    with pytest.raises(PlanChangedError, match="changed while it was being read"):
        hash_spans(path, [(((0, len(data)),), digest)], lambda: PlanChangedError("changed while it was being read"))


def test_a_write_whose_mtime_was_set_back_between_reads_and_proof_is_refused(weights: tuple[Path, bytes]) -> None:
    path, _ = weights
    ranges = ((0, 1000), (1000, 300_000), (300_000, 1 << 20))
    reads = ReadDigests({str(path): ranges})
    hashed = reads.hasher(str(path), 1000, 300_000)
    assert hashed is not None
    hashed.update(path.read_bytes()[1000:300_000])
    reads.took(str(path), 1000, 300_000, hashed)
    _write_mtime_kept(path, 2000)
    with pytest.raises(PlanChangedError, match="changed while it was being read"):
        record_contents([path], None, reads=reads)


def test_a_run_beside_a_chmod_loop_succeeds(tmp_path: Path) -> None:
    """The issue's loop, bounded, chmod-ing every input weight file while a real ``run`` reads them."""
    spec = ModelSpec(layers=4, hidden=256, intermediate=512, vocab=1024)
    a, b = make_model(tmp_path / "a", spec, seed=1), make_model(tmp_path / "b", spec, seed=2)
    files = " ".join(f"'{p}'" for m in (a, b) for p in sorted(m.glob("*.safetensors")))
    loop = subprocess.Popen(["bash", "-c", f"for i in $(seq 600); do chmod 644 {files}; sleep .01; "
                             f"chmod 600 {files}; sleep .01; done"])
    try:
        done = cli("run", write_config(tmp_path / "c.yml", linear_config(a, b)), tmp_path / "out",
                   "--state-dir", tmp_path / "state", "--quiet")
    finally:
        loop.kill()
        loop.wait()
    assert done.returncode == 0, done.stderr
    assert "changed" not in done.stderr
