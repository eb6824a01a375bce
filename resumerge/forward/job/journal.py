"""A pass's journal: one file per decoder layer, ``<prefix><layer>.safetensors``, holding the hidden states
leaving it and what the pass's client keeps beside them, each saved durably (temp file, fsync, rename, directory
fsync), so that a killed pass finds every file whole or not at all and resumes after the last one. The one reader
and the one writer of every pass's journal (:mod:`.layerpass` drives them). Its files hold host tensors whatever
device the pass runs on (:mod:`resumerge.forward.engine.device`): a pass started on a GPU resumes on the CPU, and the
other way round."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from resumerge.machine.torch_import import torch

# How a hidden state is named in a layer's file: model m's, batch s's (a pass over one model may leave out m).
HIDDEN = "hidden.{m}.{s}"


def durable_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (and safetensors ``metadata``) to ``path`` so that a kill at any instant leaves the old
    file or the new one, never part of one. A tensor on a GPU is written from a host copy: the file is the same
    whichever device computed it."""
    from safetensors.torch import save_file

    temp = path.with_name(path.name + ".tmp")
    save_file({name: t.to("cpu") for name, t in tensors.items()}, str(temp), metadata=metadata)
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


@dataclass(frozen=True)
class Restart:
    """Where a journaled pass resumes: the ``layer`` to run next, the hidden states entering it (None: none
    journaled, the pass starts from the embeddings) and what the client kept beside them in the last file
    (``tensors``, ``metadata``)."""

    layer: int = 0
    hidden: list[list[torch.Tensor]] | None = None
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Journal:
    """The journal of one pass in ``folder``: its files ``<prefix><layer:05d>.safetensors``, its hidden states
    named by ``hidden`` (:data:`HIDDEN`, formatted with ``m`` and ``s``); ``keeps_older``: a layer's file stays
    once the next is saved (the client needs what it kept beside each layer to finish: the MoE gates' vectors),
    else it is deleted then."""

    folder: Path
    prefix: str = "layer-"
    hidden: str = HIDDEN
    keeps_older: bool = False

    def path(self, layer: int) -> Path:
        return self.folder / f"{self.prefix}{layer:05d}.safetensors"

    def latest(self) -> tuple[int, Path] | None:
        return latest(self.folder, self.prefix)

    def save(self, layer: int, hidden: list[list[torch.Tensor]], kept: Mapping[str, torch.Tensor] | None = None,
             metadata: dict[str, str] | None = None) -> None:
        """Layer ``layer``'s file: the ``hidden`` states leaving it (per model, per batch) and the client's
        ``kept`` tensors and ``metadata``, durable; then (unless :attr:`keeps_older`) the older files deleted: a
        kill between the two leaves both, and a resume takes the newest."""
        tensors = {self.hidden.format(m=m, s=s): h.to("cpu").contiguous()
                   for m, model in enumerate(hidden) for s, h in enumerate(model)}
        tensors.update(kept or {})
        self.folder.mkdir(parents=True, exist_ok=True)
        durable_save(tensors, self.path(layer), metadata)
        if self.keeps_older:
            return
        for older in self.folder.glob(f"{self.prefix}*.safetensors"):
            if older.name != self.path(layer).name:
                older.unlink(missing_ok=True)

    def read(self, layer: int) -> dict[str, torch.Tensor]:
        """Every tensor of layer ``layer``'s file."""
        from safetensors.torch import load_file

        return load_file(str(self.path(layer)))

    def restart(self, models: int, batches: int) -> Restart:
        """Where the pass resumes (:class:`Restart`), for ``models`` models' hidden states of ``batches`` batches
        each; a last file without hidden states (a client that keeps none after its last layer) gives none."""
        found = self.latest()
        if found is None:
            return Restart()
        from safetensors import safe_open

        layer, path = found
        with safe_open(str(path), "pt") as opened:
            names = set(opened.keys())
            first = self.hidden.format(m=0, s=0)
            hidden = [[opened.get_tensor(self.hidden.format(m=m, s=s)) for s in range(batches)]
                      for m in range(models)] if first in names else [[] for _ in range(models)]
            held = {self.hidden.format(m=m, s=s) for m in range(models) for s in range(batches)}
            kept = {name: opened.get_tensor(name) for name in sorted(names - held)}
            metadata = dict(opened.metadata() or {})
        return Restart(layer + 1, hidden, kept, metadata)

    def clear(self) -> None:
        """Every layer file gone (the pass is done and its client has what it needed); the folder too where this
        journal had it to itself."""
        for saved in self.folder.glob(f"{self.prefix}*.safetensors*"):
            saved.unlink(missing_ok=True)

    def remove(self) -> None:
        """The journal's folder gone whole (a folder only the pass writes in)."""
        shutil.rmtree(self.folder, ignore_errors=True)
