"""Edits a content proof must see and a file's identity must not: a value changed in place outside the 16 blocks
:func:`resumerge.inputs.files.file_identity` samples; and a count of the tensors a pass reads and the files its proof
hashes (:mod:`resumerge.forward.job.proof`)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from resumerge.inputs.safetensors_format import read_header

_SAMPLES, _SAMPLE = 16, 64 * 1024  # resumerge.inputs.files.file_identity's blocks


def edit_unsampled(model: Path, tensor: str) -> Path:
    """Add 1 to one float32 value of ``tensor`` in place, outside every block the file's identity samples."""
    file = model / "model.safetensors"
    entry = read_header(file).tensors[tensor]
    size = file.stat().st_size
    sampled = [((size - _SAMPLE) * k // (_SAMPLES - 1), (size - _SAMPLE) * k // (_SAMPLES - 1) + _SAMPLE)
               for k in range(_SAMPLES)]
    at = next(o for o in range(entry.start, entry.end, 4) if not any(s <= o < e + 4 for s, e in sampled))
    with open(file, "r+b") as f:
        f.seek(at)
        value = struct.unpack("<f", f.read(4))[0]
        f.seek(at)
        f.write(struct.pack("<f", value + 1.0))
    return file


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every tensor a check reads, and every file the proof hashes, from now on."""
    from resumerge.forward.engine import reader
    from resumerge.forward.job import proof

    read: list[str] = []
    real_read, real_hash = reader.CastReader._read, proof.group_digests

    def counted(self: reader.CastReader, name: str) -> object:
        read.append(name)
        return real_read(self, name)

    def hashed(path: Path, groups: object) -> object:
        read.append(str(path))
        return real_hash(path, groups)  # type: ignore[arg-type]

    monkeypatch.setattr(reader.CastReader, "_read", counted)
    monkeypatch.setattr(proof, "group_digests", hashed)
    return read


def trust_fresh_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trust the look of a file written just before it was hashed: a test's models are made a moment before the
    pass, within the window in which a proof hashes a file again next time (git's "racy clean")."""
    from resumerge.inputs import looks

    monkeypatch.setattr(looks, "RACY_WINDOW_NS", 0)
