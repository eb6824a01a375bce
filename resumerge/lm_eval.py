"""``python -m resumerge.lm_eval ARGS...``: ``resumerge lm-eval ARGS...`` (lm-eval's own command line with ``--model
resumerge`` registered: :mod:`resumerge.cli.lmevalcmd`)."""

from __future__ import annotations

from resumerge.cli.commands import exit_with, main

if __name__ == "__main__":
    import sys

    exit_with(main(["lm-eval", *sys.argv[1:]]))
