"""``python -m resumerge`` with the hidden gates' prompt pass done on a thread of the command's process
(:func:`tests.moe.passthread.passes_on_a_thread`) instead of a process of its own: for a command whose subject is
what the pass checks or answers on another installed stack (tests/hub/test_transformers4_stack.py), not the process
it runs in. Forked from the test worker's fork server (torch imported once), the command imports that stack's
transformers once, where its pass's own interpreter imported torch and transformers again (about 6 CPU s each)."""

from __future__ import annotations

if __name__ == "__main__":
    from resumerge.cli.commands import entry
    from tests.moe.passthread import passes_on_a_thread

    with passes_on_a_thread():
        entry()
