"""GPU memory as a :class:`~resumerge.machine.memory.probe.MemoryProbe`, for ``--device cuda``.

torch is imported inside the constructor, never at module import, so ``resumerge status`` stays fast. Give the
probe its own :class:`~resumerge.machine.memory.governor.MemoryGovernor` (``pool="cuda:0"``); host and GPU budgets are
governed independently.
"""

from __future__ import annotations

from typing import Any

from resumerge.errors import UsageError

__all__ = ["CPU", "GPU_BUDGET_OPTION", "GPU_FRACTION", "CudaProbe", "is_gpu", "normalise_device"]

CPU = "cpu"
GPU_BUDGET_OPTION = "--max-gpu-memory"
# The CUDA context itself (~300-500 MB) lives outside the caching allocator that CudaProbe sees, and other
# processes may share the card: stay well short of what is free.
GPU_FRACTION = 0.85


def normalise_device(text: str) -> str:
    """Canonical device text: ``cpu``, or ``cuda:N`` (``cuda`` means ``cuda:0``; ``auto`` the first GPU when
    torch sees one, else ``cpu``). The one reading of ``--device``: a merge's (:mod:`resumerge.merge.engine.devices`)
    and a forward pass's (:mod:`resumerge.forward.engine.device`).

    Raises :class:`UsageError` for anything else (``mps``, ``cuda:x``, ...).
    """
    value = text.strip().lower()
    if value == CPU:
        return CPU
    if value == "auto":  # mergekit's --device auto: the GPU when there is one (resumerge has no XPU path)
        import torch

        return "cuda:0" if torch.cuda.is_available() else CPU
    if value == "cuda":
        return "cuda:0"
    if value.startswith("cuda:") and value[5:].isdigit():
        return f"cuda:{int(value[5:])}"
    raise UsageError(f"unknown device {text!r}", hint="use --device cpu, cuda (or cuda:N) or auto")


def is_gpu(device: str) -> bool:
    """True for a CUDA device."""
    return device.startswith("cuda")


class CudaProbe:
    """One CUDA device seen through PyTorch's caching allocator.

    ``rss()`` is ``memory_allocated`` (live tensors). ``available()`` is the driver's free memory plus what
    the allocator caches but no tensor uses (``reserved − allocated``), since our next allocation reuses that
    cache first. ``limit()`` is the device's total memory. ``reclaim()`` empties the cache, so memory other
    processes need (and fragmented cached blocks) go back to the driver.
    """

    def __init__(self, device: int | str = 0) -> None:
        """Raise :class:`~resumerge.errors.UsageError` when torch sees no CUDA device."""
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda was given but torch sees no CUDA GPU", hint="drop --device cuda")
        self._cuda: Any = torch.cuda
        self.device = torch.device(device if isinstance(device, str) else f"cuda:{device}")

    @property
    def pool(self) -> str:
        """The name to give the governor, e.g. ``"cuda:0"``."""
        index = self.device.index if self.device.index is not None else self._cuda.current_device()
        return f"cuda:{index}"

    def rss(self) -> int:
        """Bytes held by live tensors on the device."""
        return int(self._cuda.memory_allocated(self.device))

    def available(self) -> int:
        """Driver free bytes plus our allocator's unused cache."""
        free, _total = self._cuda.mem_get_info(self.device)
        cached = int(self._cuda.memory_reserved(self.device)) - self.rss()
        return int(free) + max(0, cached)

    def limit(self) -> int:
        """Total device memory."""
        _free, total = self._cuda.mem_get_info(self.device)
        return int(total)

    def reclaim(self) -> None:
        """Return the allocator's unused cached blocks to the driver."""
        self._cuda.empty_cache()

    def peak(self) -> int:
        """The allocator's exact peak of live bytes (``max_memory_allocated``) since start or reset."""
        return int(self._cuda.max_memory_allocated(self.device))
