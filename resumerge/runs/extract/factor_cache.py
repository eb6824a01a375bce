"""Finished modules' factors kept on local disk, so that an extraction killed before its adapter file was committed
recomputes none of the modules it had decomposed.

The adapter is one file (PEFT reads no other), and the journal commits whole files; this cache is what makes the
unit of lost work a module instead. It is only a cache of a pure function: an entry is named by a digest of
everything the factors depend on (module, parameters — the models' file identities among them — input shapes and
dtypes, device, torch version), holds the float32 factors the function returned with a sha256 of their bytes, and
is written to a temp file, fsynced, renamed and its folder fsynced, so it is either whole or absent
(:func:`~resumerge.machine.durable.save_entry`). A missing, unreadable or
mismatching entry is recomputed; the adapter's bytes never depend on whether an entry was there. Entries are
deleted once the adapter is committed (by the caller that ran it).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

from resumerge.machine.durable import save_entry
from resumerge.machine.torch_import import torch
from resumerge.runs.extract.state import FACTORS_SUFFIX, MODULE_KEY

_SUFFIX = FACTORS_SUFFIX


class FactorCache:
    """Factor pairs in ``directory`` (created on first store)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @staticmethod
    def key(params: Any, shapes: Any, dtypes: Any, device: str) -> str:
        """The entry name of the factors computed from these arguments."""
        text = repr((sorted(params.items()), shapes, dtypes, device, torch.__version__))
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The factors stored under ``key``, or None when absent or damaged."""
        from safetensors.torch import load_file  # imports torch: only once a factor is needed

        path = self.directory / (key + _SUFFIX)
        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
            a, b, check = tensors["a"], tensors["b"], tensors["sha256"]
        except Exception:  # damaged or foreign: recompute (the safetensors error types vary by version)
            return None
        if bytes(check.tolist()) != _digest(a, b):
            return None
        return a, b

    def store(self, key: str, a: torch.Tensor, b: torch.Tensor, *, module: str) -> None:
        """Keep ``(a, b)``, the factors of ``module``, under ``key`` (best effort: a full or read-only disk only
        costs a recomputation). The module's name goes in the entry's metadata, for ``status``."""
        check = torch.tensor(list(_digest(a, b)), dtype=torch.uint8)
        save_entry(self.directory / (key + _SUFFIX), {"a": a.contiguous(), "b": b.contiguous(), "sha256": check},
                   metadata={MODULE_KEY: module})

    def forget(self, keys: list[str]) -> None:
        """Delete the entries ``keys`` (and leftover temp files)."""
        for key in keys:
            with contextlib.suppress(OSError):
                (self.directory / (key + _SUFFIX)).unlink()
        with contextlib.suppress(OSError):
            for leftover in self.directory.glob(".*.tmp"):
                leftover.unlink()


def _digest(a: torch.Tensor, b: torch.Tensor) -> bytes:
    h = hashlib.sha256()
    for t in (a, b):
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()
