"""numba's compiler for the K-quant encoders' loops, where it is installed (the ``kquants`` extra).

The searches of :mod:`.ksearch` are many small float32 steps over every sub-block's candidates; numpy runs each step
as one call over all sub-blocks, writing a temporary per step. Compiled, a candidate's steps run fused over a row of
sub-blocks in registers, several times faster, in the same float32 operations and order: numba compiles with
IEEE semantics by default (no reassociation, no contraction into fused multiply-adds, ``fastmath`` off), and
``error_model="numpy"`` lets a division by zero give inf or NaN as C's does rather than raise. Kernels release the
GIL (``nogil``), so the merge's workers encode in parallel, and are cached on disk after their first compilation.

Where numba is missing (or refuses this Python or numpy), the encoders take their numpy path, to the same bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["compiled", "lazy_kernels", "numba_module"]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])
_Kernels = TypeVar("_Kernels")


@functools.cache
def numba_module() -> ModuleType | None:
    """numba, imported once on first use (0.3 s: never at resumerge's import), or None where it cannot be."""
    try:
        import numba
    except ImportError:  # not installed, or built for another numpy
        return None
    return numba


def compiled(fn: _Fn) -> _Fn | None:
    """``fn`` compiled by numba as C runs it (module docstring), or None without numba."""
    numba = numba_module()
    return None if numba is None else _njit(numba, fn)


def lazy_kernels(make: Callable[..., _Kernels], *fns: Callable[..., Any]) -> Callable[[], _Kernels | None]:
    """The function giving ``make(*fns compiled)``, compiled once a process on its first call (numba compiles a
    kernel on its first call with those types, or loads it from its disk cache), or None while numba is missing:
    checked on each call, so a test that takes numba away takes the kernels too."""

    @functools.cache
    def built(numba: ModuleType) -> _Kernels:
        return make(*(_njit(numba, fn) for fn in fns))

    def kernels() -> _Kernels | None:
        numba = numba_module()
        return None if numba is None else built(numba)

    return kernels


def _njit(numba: ModuleType, fn: _Fn) -> _Fn:
    options: dict[str, Any] = {"nogil": True, "error_model": "numpy", "fastmath": False, "boundscheck": False}
    try:
        kernel: _Fn = numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # numba's "no locator available": no cache directory it can write, so compiled each process
        kernel = numba.njit(**options)(fn)
    return kernel
