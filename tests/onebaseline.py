"""``python -m resumerge`` whose runs measure the fresh process of their baseline without compiled kernels, as
:func:`encoderparity.one_baseline` has the encoder tests' runs in the test process measure it: those tests' own
commands (the runs their kill tests kill, a run llama.cpp then loads) run it (``support.cli(..., script=
encoderparity.ONE_BASELINE)``), forked from the worker's fork server as ``python -m resumerge`` is, a real process
of its own. Without it, each set of types such a command writes that no run of the session measured before (the
2-bit mixes', the K-quants' and IQ4's) is measured once in a fresh process importing torch and numba and loading that
set's kernels, 4-5 CPU s, for tests that check bytes and resumption, not memory (tests/test_gguf_memory.py checks the
kernels' baselines)."""

from __future__ import annotations

from resumerge.merge.engine import footprint


def _no_kernels(spec: str) -> str:
    """:func:`~resumerge.merge.engine.footprint.measured_spec` as ``one_baseline`` sets it: no kernel set."""
    return ""


if __name__ == "__main__":
    footprint.measured_spec = _no_kernels
    from resumerge.cli.commands import entry

    entry()
