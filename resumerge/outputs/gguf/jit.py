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
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any, Generic, TypeVar

__all__ = ["LazyKernels", "compiled", "lazy_kernels", "numba_module", "on_disk"]

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


@dataclass(frozen=True, eq=False)
class LazyKernels(Generic[_Kernels]):
    """``make(*declared compiled)``, compiled once a process on its first call (numba compiles a kernel on its first
    call with those types, or loads it from its disk cache), or None while numba is missing: checked on each call,
    so a test that takes numba away takes the kernels too. ``declared`` is read by :func:`on_disk` from the module
    holding it (no registry: the module's own attribute says which kernels it declares)."""

    make: Callable[..., _Kernels]
    declared: tuple[Callable[..., Any], ...]
    # Plain functions the kernels call (a step written once for several loops), compiled where a kernel calls them,
    # with the kernels' options; numba's disk cache is keyed on the kernel's file, so a helper lives beside its kernels.
    helpers: tuple[Callable[..., Any], ...] = ()

    def __call__(self) -> _Kernels | None:
        numba = numba_module()
        return None if numba is None else _built(self, numba)


@functools.cache
def _built(lazy: LazyKernels[_Kernels], numba: ModuleType) -> _Kernels:
    for helper in lazy.helpers:
        _callable_in_kernels(helper, numba)
    return lazy.make(*(_njit(numba, fn) for fn in lazy.declared))


@functools.cache
def _callable_in_kernels(fn: Callable[..., Any], numba: ModuleType) -> None:
    """Let compiled kernels call the plain function ``fn`` (registered once a process: numba keeps one overload)."""
    from numba.extending import register_jitable

    register_jitable(**_OPTIONS)(fn)


def lazy_kernels(make: Callable[..., _Kernels], *fns: Callable[..., Any],
                 helpers: tuple[Callable[..., Any], ...] = ()) -> LazyKernels[_Kernels]:
    """:class:`LazyKernels` of ``make`` over ``fns``, which may call ``helpers``."""
    return LazyKernels(make, fns, helpers)


def on_disk(modules: Iterable[str]) -> bool:
    """Whether numba's disk cache was filled before for ``modules`` (imported ones): it holds an index of some kernel
    that they, or the modules of this package they import, declare (:func:`lazy_kernels`). A fresh cache (a new
    runtime's) holds none: there one process compiling them ahead saves each process after it its own compilation;
    a cache holding some is taken as filled (a kernel not in it yet is compiled by the first process that loads it).
    True without numba or without a cache numba can keep: there is nothing to compile ahead for another process."""
    numba = numba_module()
    if numba is None:
        return True
    package = __name__.rpartition(".")[0]
    seen: set[str] = set()
    pending = list(modules)
    while pending:
        name = pending.pop()
        if name in seen or name not in sys.modules:
            continue
        seen.add(name)
        pending.extend(value.__name__ for value in vars(sys.modules[name]).values()
                       if isinstance(value, ModuleType) and value.__name__.startswith(package + "."))
    try:
        from numba.core.caching import FunctionCache

        return any(os.path.exists(FunctionCache(fn)._cache_file._index_path)  # type: ignore[no-untyped-call]
                   for name in seen for value in vars(sys.modules[name]).values()
                   if isinstance(value, LazyKernels) for fn in value.declared)
    except Exception:  # no cache directory numba can write (each process compiles), or numba's internals moved
        return True


# C's float semantics (module docstring), for kernels and the helpers they call alike
_OPTIONS: Mapping[str, Any] = MappingProxyType({"error_model": "numpy", "fastmath": False, "boundscheck": False})


def _njit(numba: ModuleType, fn: _Fn) -> _Fn:
    options: dict[str, Any] = {"nogil": True, **_OPTIONS}
    try:
        kernel: _Fn = numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # numba's "no locator available": no cache directory it can write, so compiled each process
        kernel = numba.njit(**options)(fn)
    return kernel
