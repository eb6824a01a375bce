"""The shard writer asks the disk to start writing its bytes while the merge goes on, so that the final fsync does
not write the whole shard after the work that made it; the file and its hash are those of a writer that does not."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from resumerge.inputs.safetensors_format import layout_shard
from resumerge.machine import durable
from resumerge.machine.checksums import SHA256, XXH3_128, Checksum
from resumerge.merge.store import shardwriter
from resumerge.merge.store.shardwriter import ShardWriter
from resumerge.merge.store.sink import LocalDirSink


def _write_shard(out: Path, tensors: dict[str, torch.Tensor], checksum: Checksum = SHA256) -> tuple[str, Path]:
    layout = layout_shard({name: ("F32", tuple(t.shape)) for name, t in tensors.items()})
    writer = ShardWriter(LocalDirSink(out), "model.safetensors", layout, checksum=checksum)
    for planned in layout.order:
        assert writer.write(planned.name, {planned.name: tensors[planned.name]})
    _, sha, _ = writer.finish()
    return sha, out / "model.safetensors"


@pytest.mark.parametrize("checksum", [SHA256, XXH3_128], ids=lambda c: c.name)
def test_writeback_starts_every_few_mib_written_and_changes_no_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    checksum: Checksum) -> None:
    started: list[int] = []
    monkeypatch.setattr(shardwriter, "_WRITEBACK_BYTES", 1 << 20)
    monkeypatch.setattr(shardwriter, "start_writeback", started.append)
    tensors = {f"t{i}": torch.arange(i, i + (1 << 17), dtype=torch.float32) for i in range(5)}  # 512 KiB each
    sha, path = _write_shard(tmp_path, tensors, checksum)
    assert len(started) == 2  # after 1 MiB and 2 MiB of the 2.5 MiB written
    data = path.read_bytes()  # hashed here by the libraries themselves
    assert sha == (hashlib.sha256(data).hexdigest() if checksum == SHA256 else
                   "xxh3-128:" + xxhash.xxh3_128_hexdigest(data))
    assert all(torch.equal(load_file(path)[name], t) for name, t in tensors.items())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_start_writeback_calls_the_kernel_and_is_off_without_durability(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    call = durable._sync_file_range()
    assert call is not None
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"x" * 65536)
        assert call(fd, 0, 0, durable._SYNC_FILE_RANGE_WRITE) == 0  # the binding's types are the kernel's
        assert call(-1, 0, 0, durable._SYNC_FILE_RANGE_WRITE) == -1
        durable.start_writeback(fd)
        durable.start_writeback(-1)  # best effort: a failure raises nothing
        calls: list[int] = []
        monkeypatch.setattr(durable, "_sync_file_range", lambda: lambda *args: calls.append(args[0]) or 0)
        monkeypatch.setenv(durable.UNSAFE_NO_FSYNC_ENV, "1")
        durable.start_writeback(fd)
        assert calls == []
        monkeypatch.delenv(durable.UNSAFE_NO_FSYNC_ENV)
        durable.start_writeback(fd)
        assert calls == [fd]
    finally:
        os.close(fd)
