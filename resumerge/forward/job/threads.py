"""The thread count a forward pass computes with: decided once, as the pass first starts, kept in its folder, and
applied to every later step, a resumed one on a machine of another core count included.

A forward pass's figures depend on torch's thread count: a matmul's or an attention's reduction split over two
threads rounds otherwise than over one (a search's KL on the tests' tiny models: 0.007962717729 on two threads,
0.007962716593 on one). A pass killed on a machine of N cores and resumed on one of M then computed its later
layers, and the candidates scored after the resume, with M threads: other bits than the same pass run whole. So
the count is the pass's own state, written beside its journal (:data:`~resumerge.machine.threadcount.THREADS_FILE`,
before its first layer) and read back by the process that resumes it, as the merge engine decides its kernel
threads from the run's settings alone (:mod:`resumerge.inputs.kernels`).

The count is torch's as the pass first starts: ``-j`` where the command sets it, else the machine's (or
``OMP_NUM_THREADS``'s); a search (``evolve``) decides one for all its passes the same way and records it in its
STORAGE. It is applied to the calling thread alone (:func:`~resumerge.inputs.kernels.kernel_threads`: OpenMP's and
MKL's per-thread counts, put back as the pass ends; the passes compute on the thread that drives them), so the
process's default for threads started later, which a notebook or the merge engine's workers read, does not change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from resumerge.inputs.kernels import kernel_threads
from resumerge.machine.threadcount import decided_threads


@contextmanager
def pass_threads(file: Path) -> Iterator[int]:
    """The block computing with the thread count kept in ``file`` (decided and recorded there where none is yet:
    :func:`~resumerge.machine.threadcount.decided_threads`); the block gets it."""
    count = decided_threads(file.parent, file.name)
    with kernel_threads(count):
        yield count
