"""Tensor bytes in and out: read one input tensor by ``pread``, view an output tensor's bytes without copying.

Reads use ``os.pread`` into a fresh buffer rather than mmap: file-backed mmap pages count in RSS and in the
cgroup's usage until the kernel reclaims them, which makes a memory budget unenforceable; a pread buffer is
freed the moment the tensor is dropped. ``pread`` takes no file position, so reader threads share descriptors.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from resumerge.errors import StorageError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
NAME_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
_CHUNK = 1 << 30  # Linux caps one read at just under 2 GiB


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

    def read(self, path: Path, start: int, end: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Return the tensor stored at ``[start, end)`` of ``path``; raises StorageError on a short read."""
        nbytes = end - start
        if nbytes == 0:
            return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        # torch.empty, not bytearray: a bytearray is zero-filled first, a whole extra pass over every input byte.
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = buf.numpy().data
        fd = self._fd(path)
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done : done + _CHUNK]], start + done)
            if n <= 0:
                raise StorageError(
                    f"{path.name} ended early while reading ({done} of {nbytes} bytes)",
                    path=str(path),
                    hint="the input file changed or was truncated during the merge; restore it and resume",
                )
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
