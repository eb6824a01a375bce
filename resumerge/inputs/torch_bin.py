"""PyTorch ``.bin`` checkpoints (``pytorch_model.bin``, or shards named by ``pytorch_model.bin.index.json``).

A ``.bin`` file is a pickle. It is only ever opened with PyTorch's weights-only unpickler
(``torch.load(weights_only=True, mmap=True)``), which builds tensors and plain containers from an allowlist and
refuses everything else — custom classes, ``os.system`` and other callables — before running it; refusals are
:class:`~resumerge.errors.HostileFileError` (exit 2). Legacy non-zip pickles cannot be memory-mapped and are
refused too. With ``mmap=True`` no tensor data is read while opening: the result is the header-equivalent index.
Before torch 2.10 that unpickler can itself be made to run code by a crafted file (CVE-2026-24747,
GHSA-63cw-57p8-fm3p): under an older torch a ``.bin`` is refused unread (:func:`refuse_unsafe_unpickler`), while the
plan is made (a hub model's before its download).

Each tensor gets a *virtual* byte range: the file's tensors, sorted by name, laid end to end as their contiguous
bytes. Plans and the engine address ``.bin`` tensors by these ranges exactly as they address safetensors byte
ranges (row chunks included); :class:`PickleReader` serves a range from the memory-mapped tensor, copying it out
with ``contiguous()`` first when the stored tensor is a non-contiguous or offset view (mergekit's lazy unpickler
misreads those). The identity of a ``.bin`` file covers every tensor's name, dtype, shape, stride and storage
offset, plus sampled blocks of the file, so a resume notices a changed checkpoint.
"""

from __future__ import annotations

import bisect
import functools
import importlib.metadata
import json
import pickle
import re
import threading
import zipfile
from collections.abc import Mapping
from pathlib import Path

from resumerge.errors import HostileFileError, ModelInputError, PlanChangedError
from resumerge.inputs.safetensors_format import Header, TensorEntry
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.machine.torch_import import torch

BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_SINGLE_NAME = "pytorch_model.bin"
# The first torch whose weights-only unpickler is not known to run a crafted pickle's code (CVE-2026-24747).
SAFE_UNPICKLER = (2, 10)


@functools.cache
def _codes() -> dict[torch.dtype, str]:
    """safetensors' name of each torch dtype (built on first use: building it imports torch)."""
    return {dtype: code for code, dtype in TORCH_DTYPES.items()}


def is_pickle_checkpoint(name: str) -> bool:
    """Whether weight file ``name`` is a PyTorch pickle (read through this module, never by byte offset)."""
    return name.endswith(".bin")


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor), from its package metadata: torch is not imported for it."""
    found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    return (int(found[1]), int(found[2])) if found else (0, 0)


def refuse_unsafe_unpickler(name: str, where: str) -> None:
    """Raise :class:`ModelInputError` (exit 2) for the pickled checkpoint ``name`` (of the model at ``where``) where
    the installed torch's weights-only unpickler is one a crafted pickle can run code through (before
    :data:`SAFE_UNPICKLER`): called before the file is read, or downloaded."""
    release = torch_release()
    if release < SAFE_UNPICKLER:
        raise ModelInputError(
            f"{name} is a pickle, and the weights-only unpickler of the torch installed "
            f"({release[0]}.{release[1]}) can be made to run a crafted file's code (CVE-2026-24747, fixed in torch "
            f"{SAFE_UNPICKLER[0]}.{SAFE_UNPICKLER[1]}); it was not read", path=where,
            hint="convert the model to safetensors, or upgrade torch to 2.10 or later")


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the ``.bin`` file at ``path``, memory-mapped (no data read), by name.

    Raises :class:`ModelInputError` under a torch whose unpickler is unsafe (:func:`refuse_unsafe_unpickler`, nothing
    read), :class:`HostileFileError` when the weights-only unpickler refuses the file (nothing in it ran), and
    :class:`ModelInputError` for a legacy or damaged file or one that is not a flat dict of dense tensors.
    """
    where = str(path)
    refuse_unsafe_unpickler(path.name, str(path.parent))
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise HostileFileError(
            f"{path.name} holds objects PyTorch's weights-only loader refuses (code or custom classes)",
            path=where, hint="nothing in it was run; only plain state dicts of tensors are read",
        ) from None
    except (RuntimeError, ValueError, EOFError, OSError, zipfile.BadZipFile, KeyError) as exc:
        raise ModelInputError(
            f"{path.name} is not a readable zip-format PyTorch checkpoint ({str(exc).splitlines()[0][:120]})",
            path=where, hint="re-save it with torch.save (PyTorch 1.6 or later) or convert it to safetensors",
        ) from None
    if not isinstance(loaded, dict) or not loaded:
        raise ModelInputError(f"{path.name} does not hold a state dict (a dict of tensors)", path=where)
    state: dict[str, torch.Tensor] = {}
    for name, value in loaded.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ModelInputError(
                f"{path.name}: entry {str(name)[:80]!r} is not a tensor", path=where,
                hint="a state dict wrapped in another object ({'state_dict': ...}) must be unwrapped first",
            )
        if value.layout is not torch.strided or value.is_quantized or value.dtype not in _codes():
            raise ModelInputError(f"{path.name}: tensor {name!r} is sparse, quantized or of dtype {value.dtype}, "
                                  "which cannot be merged", path=where, tensor=name)
        state[name] = value
    return state


def read_bin_header(path: Path) -> Header:
    """The header-equivalent index of the ``.bin`` file at ``path``: each tensor's dtype, shape and virtual byte
    range (see the module docstring); ``raw`` describes every tensor's storage view for the file's identity."""
    state = load_state(path)
    entries: dict[str, TensorEntry] = {}
    described = []
    offset = 0
    for name in sorted(state):
        tensor = state[name]
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = TensorEntry(name, _codes()[tensor.dtype], tuple(tensor.shape), offset, offset + nbytes)
        described.append([name, _codes()[tensor.dtype], list(tensor.shape), list(tensor.stride()),
                          tensor.storage_offset()])
        offset += nbytes
    raw = json.dumps(described, separators=(",", ":")).encode()
    return Header(entries, {}, 0, path.stat().st_size, raw)


class PickleReader:
    """Serves virtual byte ranges of a model folder's ``.bin`` files; each file is opened (memory-mapped) once,
    on first use, and kept until :meth:`close`. Safe to call from several threads."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._files: dict[str, tuple[list[int], list[str], Mapping[str, torch.Tensor]]] = {}

    def _open(self, file: str) -> tuple[list[int], list[str], Mapping[str, torch.Tensor]]:
        with self._lock:
            found = self._files.get(file)
            if found is None:
                state = load_state(self._directory / file)
                starts, names, offset = [], [], 0
                for name in sorted(state):
                    starts.append(offset)
                    names.append(name)
                    offset += state[name].numel() * state[name].element_size()
                found = self._files[file] = (starts, names, state)
            return found

    def read_range(self, file: str, start: int, end: int) -> torch.Tensor:
        """Virtual bytes ``[start, end)`` of ``file`` as a fresh uint8 tensor; they must lie in one tensor.

        Raises :class:`PlanChangedError` when the file no longer holds a tensor there (it changed since the
        plan was made).
        """
        starts, names, state = self._open(file)
        i = bisect.bisect_right(starts, start) - 1
        tensor = state[names[i]] if i >= 0 else None
        if tensor is None or end - starts[i] > tensor.numel() * tensor.element_size():
            raise PlanChangedError(
                f"{self._directory / file} no longer holds the tensor planned at bytes [{start}, {end})",
                path=str(self._directory / file), hint="restore the input as it was, or start over with --restart",
            )
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        return flat[start - starts[i]:end - starts[i]].clone()

    def close(self) -> None:
        """Drop every memory map."""
        with self._lock:
            self._files.clear()
