"""Tensor bytes in and out: read one input tensor by ``pread``, view an output tensor's bytes without copying.

Reads use ``os.pread`` into a fresh buffer rather than mmap: file-backed mmap pages count in RSS and in the
cgroup's usage until the kernel reclaims them, which makes a memory budget unenforceable; a pread buffer is
freed the moment the tensor is dropped. ``pread`` takes no file position, so reader threads share descriptors.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from resumerge.errors import StorageError
from resumerge.machine.torch_import import torch


class _Dtypes(Mapping[str, "torch.dtype"]):
    """Names to torch dtypes, looked up when read: building the table at import would import torch."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self._names = dict(names)

    def __getitem__(self, key: str) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self._names[key])
        return dtype

    def __contains__(self, key: object) -> bool:
        return key in self._names  # Mapping's own would read the dtype, so import torch

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# safetensors' dtype names, and torch's name for each (read without importing torch).
DTYPE_NAMES: Mapping[str, str] = MappingProxyType({
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
})
TORCH_DTYPES: Mapping[str, torch.dtype] = _Dtypes(DTYPE_NAMES)
# A config's dtype names.
NAME_DTYPES: Mapping[str, torch.dtype] = _Dtypes({name: name for name in (
    "float64", "float32", "float16", "bfloat16", "int64")})
_CHUNK = 1 << 30  # Linux caps one read at just under 2 GiB
# A read whose bytes are hashed as they come reads this much at a time: each piece is hashed while it is still in
# the CPU's cache, not read again from memory once the whole tensor is in (issue 72, bench/RESULTS.md).
_HASHED = 2 << 20


class Digest(Protocol):
    """What a read feeds its bytes to (xxhash's and hashlib's hash objects alike)."""

    def update(self, data: memoryview, /) -> None: ...


class TensorReader:
    """Reads tensors by absolute byte range from files, keeping descriptors open until :meth:`close`."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                self._fds[path] = fd
            return fd

    def read(self, path: Path, start: int, end: int, dtype: str, shape: tuple[int, ...],
             into: torch.Tensor | None = None, digest: Digest | None = None) -> torch.Tensor:
        """Return the tensor stored at ``[start, end)`` of ``path``, in the first bytes of ``into`` when given (a
        contiguous uint8 CPU tensor: a buffer reused from one tensor to the next has its pages already, where a
        fresh one over the mmap threshold is faulted in and zeroed by the kernel), its bytes fed to ``digest`` as
        they are read (a piece at a time, still in the CPU's cache); raises StorageError on a short read."""
        nbytes = end - start
        if nbytes == 0:
            return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        # torch.empty, not bytearray: a bytearray is zero-filled first, a whole extra pass over every input byte.
        buf = torch.empty(nbytes, dtype=torch.uint8) if into is None else into.view(torch.uint8).view(-1)[:nbytes]
        view = buf.numpy().data
        fd = self._fd(path)
        done = 0
        step = _CHUNK if digest is None else _HASHED
        while done < nbytes:
            n = os.preadv(fd, [view[done : done + step]], start + done)
            if n <= 0:
                raise StorageError(
                    f"{path.name} ended early while reading ({done} of {nbytes} bytes)",
                    path=str(path),
                    hint="the input file changed or was truncated during the merge; restore it and resume",
                )
            if digest is not None:
                digest.update(view[done : done + n])
            done += n
        return buf.view(TORCH_DTYPES[dtype]).reshape(shape)

    def close(self) -> None:
        """Close every descriptor."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor; the tensor must outlive the view."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")
