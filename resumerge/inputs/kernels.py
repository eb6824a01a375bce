"""Serial torch kernels in one thread while the others keep their intra-op parallelism.

A tensor streamed in row chunks runs a few dozen kernels per chunk of about 128 Ki entries. Split over torch's
OpenMP threads, each of those kernels waits for a second thread that other work keeps busy: on a busy 2-core
machine two bfloat16 tensors of 4 Mi entries took 17 s streamed with two threads and 0.4 s with one. The engine's
own worker threads already fill the cores, so a chunked computation runs its kernels serially instead, and so does
a whole tensor's when the workers are at least torch's threads (the blocked methods, DELLA's ranking and the
task-vector combine, issue thousands of block-sized kernels per tensor). A quantized tensor's decode is such a
run of small kernels too (one FP8 tensor: 8 M values/s over two busy threads, ~200 M on one), and every reader
decodes (the engine's workers, the MoE and LoRA-extraction preparation), so this lives with the inputs they all
read through (:func:`~resumerge.merge.plan.inputrefs.read_value` decodes in it).

torch's ``set_num_threads`` also changes the default of every thread started later, so this sets the calling
thread's OpenMP thread count alone, through the OpenMP runtime torch loaded (``omp_set_num_threads`` is per
thread). Where that runtime is not found (another threading backend, no ``/proc``), nothing changes: the kernels
stay parallel, which is slower, and the block says so (a timing by this thread's CPU would then count only its
share of the work). Row chunks get the same bits either way (the methods streamed this way reduce
only across inputs, never along a tensor); a reduction along a whole tensor (a rescale's L1 norms, slerp's norms)
does not, as torch splits a long sum into one part per thread. So the engine decides where kernels run from the
run's settings alone (its workers, torch's threads, the device), never from the moment's load or memory: a resumed
run then computes every tensor exactly as the first one did.

MKL (torch's BLAS and LAPACK on x86) keeps a thread count of its own. It follows the calling thread's OpenMP count
only while its "dynamic" mode is on, which it is until the process's first ``torch.set_num_threads`` (a ``-j``, or
any library or notebook cell that sets it once) turns it off for good: from then on a "serial" block's products,
QRs and SVDs were split over torch's threads again, so the same run computed other bits after a ``-j 2`` than
without one, and in a process that had once set the count than in a fresh one (issue 87: measured on a 1024 × 2816
truncation). So the block pins MKL's count for the calling thread too (``mkl_set_num_threads_local``, which wins
over MKL's global count and its dynamic mode).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from resumerge.machine.torch_import import torch


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch uses among this process's loaded libraries, or None.

    Other wheels bring their own copy (sentencepiece, which transformers loads, maps ``libgomp-….so`` from its
    ``.libs`` folder); setting that copy's thread count changes nothing for torch, so the run would silently split
    whole-tensor sums over torch's threads — other bits than a fresh process computes. torch's own copy (under its
    package, or the ``torch.libs`` folder beside it) is taken first; another runtime only when torch's is not found
    by name (a build linked against the system's).
    """
    # torch first: it is imported lazily, and a first call before its import would find no runtime mapped yet and
    # cache that, leaving every later "serial" kernel split over torch's threads.
    home = Path(torch.__file__).resolve().parent
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = [path for path in dict.fromkeys(line.split()[-1] for line in maps.splitlines() if line.split())
             if Path(path).name.startswith(("libgomp", "libiomp"))]
    ours = [path for path in found if Path(path).resolve().parent in (home / "lib", home.parent / "torch.libs")]
    for path in ours or found[:1]:
        try:
            runtime = ctypes.CDLL(path)
            runtime.omp_get_max_threads.restype = ctypes.c_int
            return runtime
        except (OSError, AttributeError):
            return None
    return None


@functools.cache
def _mkl_local() -> Callable[[int], int] | None:
    """MKL's ``mkl_set_num_threads_local`` inside torch's own library (MKL is linked into it), or None where torch
    has no MKL (another BLAS, which follows the OpenMP count) or the library is not found by that name. Its C entry
    point, ``MKL_Set_Num_Threads_Local``: the lower-case symbols are the Fortran ones (the count by address).

    It sets the calling thread's MKL thread count and returns the one it replaces (0: none of its own, MKL's global
    count applies), which is how the count is given back."""
    lib = Path(torch.__file__).resolve().parent / "lib" / "libtorch_cpu.so"  # loaded already: the same handle
    try:
        setter = ctypes.CDLL(str(lib)).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    setter.restype = ctypes.c_int
    setter.argtypes = [ctypes.c_int]
    return cast("Callable[[int], int]", setter)


@contextmanager
def serial_kernels() -> Iterator[bool]:
    """Run torch's CPU kernels of the calling thread on that thread alone inside the block, MKL's among them; the
    block gets whether they do (False: no OpenMP runtime found, the kernels stay on torch's threads)."""
    with kernel_threads(1, process_wide=False) as serial:
        yield serial


@contextmanager
def kernel_threads(count: int, *, process_wide: bool = True) -> Iterator[bool]:
    """Run torch's CPU kernels of the calling thread on ``count`` threads inside the block, MKL's among them, and
    put the thread's counts back as it ends; no other thread's count, nor the default of threads started later,
    changes. The block gets whether they do: where no OpenMP runtime is found, ``process_wide`` sets torch's
    process-wide count instead (put back as the block ends: a forward pass, whose figures depend on it), else
    nothing changes (False)."""
    runtime = _openmp()
    if runtime is None:
        if not process_wide:
            yield False
            return
        before_all = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            yield True
        finally:
            torch.set_num_threads(before_all)
        return
    # torch sets each thread's OpenMP (and MKL) thread count lazily, at the thread's first parallel kernel; asking
    # for it first makes that happen now, so it cannot overwrite the settings below later.
    torch.get_num_threads()
    before = int(runtime.omp_get_max_threads())
    mkl = _mkl_local()
    runtime.omp_set_num_threads(count)
    mkl_before = mkl(count) if mkl is not None else 0
    try:
        yield True
    finally:
        if mkl is not None:
            mkl(mkl_before)
        runtime.omp_set_num_threads(before)
