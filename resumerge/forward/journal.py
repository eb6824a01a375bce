"""A pass's journal: tensors saved durably (temp file, fsync, rename, directory fsync), so that a killed pass
finds every file whole or not at all, and resumes after the last one."""

from __future__ import annotations

import os
from pathlib import Path

from resumerge.torch_import import torch


def durable_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (and safetensors ``metadata``) to ``path`` so that a kill at any instant leaves the old
    file or the new one, never part of one."""
    from safetensors.torch import save_file

    temp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temp), metadata=metadata)
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest(workdir: Path, prefix: str) -> tuple[int, Path] | None:
    """The highest layer number of the files ``<prefix><layer>.safetensors`` in ``workdir`` and its file (None:
    none saved)."""
    saved = sorted(workdir.glob(f"{prefix}*.safetensors"))
    if not saved:
        return None
    return int(saved[-1].stem.removeprefix(prefix)), saved[-1]
