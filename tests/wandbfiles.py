"""W&B's offline run files read back (wandb 0.31 has no Python reader: its core is Go): each ``run-<id>.wandb`` is a
LevelDB-log stream (a 7-byte header, 32 KiB blocks of records: crc32, length, type) of
``wandb_internal_pb2.Record`` protobufs. For tests that log offline (``WANDB_MODE=offline``, a tmp ``WANDB_DIR``)."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

_BLOCK = 32768  # W&B's transaction log: LevelDB-log blocks of records (type 1 whole; 2, 3, 4 first, middle, last)


def _records(path: Path) -> list[bytes]:
    data, at, part, found = path.read_bytes(), 7, b"", []
    while at + 7 <= len(data):
        left = _BLOCK - at % _BLOCK
        if left < 7:
            at += left
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if length == 0 and kind == 0:  # the block's padding
            at += left
            continue
        if at + 7 + length > len(data):  # a record its service is still writing
            break
        chunk, at = data[at + 7:at + 7 + length], at + 7 + length
        if kind == 1:
            found.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            found.append(part + chunk)
    return found


def wandb_rows(root: Path) -> tuple[list[dict[str, str]], set[str], list[str]]:
    """Every history row of every offline run under ``root``, the runs' ids, the artifacts' names."""
    from wandb.proto import wandb_internal_pb2

    rows, ids, artifacts = [], set(), []
    for path in sorted(root.rglob("run-*.wandb")):
        ids.add(path.stem.removeprefix("run-"))
        for raw in _records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                # W&B splits a key at its slashes ("candidate/objective": nested_key)
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
            elif kind == "artifact":
                artifacts.append(record.artifact.name)
    return rows, ids, artifacts




def wandb_rows_once(root: Path, written: Callable[[list[dict[str, str]], list[str]], bool],
                    timeout: float = 60.0) -> tuple[list[dict[str, str]], set[str], list[str]]:
    """:func:`wandb_rows` once ``written(rows, artifacts)`` holds of them, or as they are after ``timeout`` seconds:
    ``run.finish()`` can return before W&B's service process has written the last records of an offline run file
    (lm-eval's door read them a moment early under load, the rows there when looked at after the test)."""
    deadline = time.monotonic() + timeout
    while True:
        found = wandb_rows(root)
        if written(found[0], found[2]) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
