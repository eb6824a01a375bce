"""``python -m resumerge`` with torch on one thread, as ``OMP_NUM_THREADS=1`` starts it: the commands a test compares
with a reference computed on one thread (support.one_thread: float32 sums on more threads may round otherwise) run
it in a process of their own (``support.cli(..., script=ONE_THREAD)``). Set in the process rather than in its
environment, the command is forked from the test worker's fork server (torch imported once) where ``OMP_NUM_THREADS``
would start a fresh interpreter; the processes it starts itself (a mergekit-moe prompt pass) inherit the variable."""

from __future__ import annotations

import os

import torch

if __name__ == "__main__":
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # as support.one_thread sets the reference's (torch's OpenMP pool is not made yet)
    from resumerge.cli.commands import entry

    entry()
