"""Approximated batches kept durably in the run's folder, so a transplant killed in the middle of a matrix
recomputes only the batch it was in.

The journal commits whole shards, and the token embedding of a 150k-token vocabulary is one tensor: this store is
what makes the unit of lost work a batch of tokens. It only caches a pure function: an entry is named by a digest
of everything the batch's rows follow from (the matrix's parameters — the two models' file identities and the
match's digest among them — the batch's number, the dtype, device and torch version), holds the rows with a sha256
of their bytes, and is written to a temp file, fsynced, renamed and its folder fsynced, so it is either whole or
absent; a missing, unreadable or mismatching entry is computed again. The output's bytes never depend on whether an
entry was there. Entries are deleted once the run is done.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from resumerge.machine import killpoints
from resumerge.machine.durable import save_entry
from resumerge.machine.torch_import import torch

BATCHES_DIR = "tokensurgeon-batches"
SUFFIX = ".rows"


class BatchStore:
    """Batches' rows in ``directory`` (created on first store)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @staticmethod
    def key(params: Any, batch: int) -> str:
        """The entry name of batch ``batch`` of the matrix of ``params``."""
        text = repr((sorted(params.items()), batch, torch.__version__))
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> torch.Tensor | None:
        """The rows stored under ``key``, or None when absent or damaged."""
        from safetensors.torch import load_file

        path = self.directory / (key + SUFFIX)
        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
            rows, check = tensors["rows"], tensors["sha256"]
        except Exception:  # damaged or foreign: compute again (the safetensors error types vary by version)
            return None
        return rows if bytes(check.tolist()) == _digest(rows) else None

    def store(self, key: str, rows: torch.Tensor) -> None:
        """Keep ``rows`` under ``key`` durably, then reach :data:`BATCH_POINT`. A full or read-only disk only
        costs a recomputation on resume."""
        check = torch.tensor(list(_digest(rows)), dtype=torch.uint8)
        if not save_entry(self.directory / (key + SUFFIX), {"rows": rows.contiguous(), "sha256": check}):
            return
        killpoints.reach("after_surgery_batch")  # each batch's entry durable (tests kill there)

    def count(self) -> int:
        """How many batches are kept (``status``)."""
        try:
            return sum(1 for _ in self.directory.glob("*" + SUFFIX))
        except OSError:
            return 0

    def clear(self) -> None:
        """Delete every entry (the run is done, or discarded by ``--restart``)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _digest(rows: torch.Tensor) -> bytes:
    h = hashlib.sha256(str((rows.dtype, tuple(rows.shape))).encode())
    h.update(rows.contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()
