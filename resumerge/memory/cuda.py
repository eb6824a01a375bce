"""GPU memory as a :class:`~resumerge.memory.probe.MemoryProbe`, for ``--device cuda``.

torch is imported inside the constructor, never at module import, so ``resumerge status`` stays fast. Give the
probe its own :class:`~resumerge.memory.governor.MemoryGovernor` (``pool="cuda:0"``); host and GPU budgets are
governed independently.
"""

from __future__ import annotations

from typing import Any

from resumerge.errors import UsageError

__all__ = ["CudaProbe"]


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
