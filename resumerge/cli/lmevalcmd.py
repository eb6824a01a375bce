"""``resumerge lm-eval ARGS...`` (and ``python -m resumerge.lm_eval ARGS...``): lm-eval's own command line, parsed by
lm-eval's own parser (``lm-eval run|ls|validate``, and its legacy form without ``run``), with ``--model resumerge``
registered; its one :func:`resumerge.api.lm_eval` call. Every flag is lm-eval's, so ``--help`` is lm-eval's, followed by
what it cannot say: the ``resumerge`` model's ``--model_args`` and what ``--use_cache`` is to it."""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
from collections.abc import Sequence

from resumerge.errors import EXIT_OK

HELP = ("lm-eval's own command line (lm-eval run --model resumerge --model_args pretrained=PATH ...), every flag "
        "as lm-eval parses it")

# What lm-eval's own --help cannot say: the model resumerge registers, its model_args, what --use_cache is to it
MODEL_HELP = ("--model resumerge takes --model_args pretrained=PATH (a model folder, a GGUF file, hf://NAMESPACE/NAME "
              "or a merge config, merged as it is read, never written), max_memory=SIZE, max_gpu_memory=SIZE, "
              "device=cpu|cuda[:N], state_dir=DIR; --use_cache DIR keeps resumerge's journal there (a rerun answers "
              "what is done without reading a weight). Needs the eval extra.")


DESCRIPTION = f"{HELP}. {MODEL_HELP}"
ADD_HELP = False  # its --help is lm-eval's


def add_arguments(door: argparse.ArgumentParser) -> None:
    """The ``lm-eval`` command's entry in ``resumerge --help``; its words are parsed by lm-eval's own parser (see
    :func:`run_lm_eval_command`), never by this one."""
    door.add_argument("words", nargs=argparse.REMAINDER, metavar="ARGS", help="lm-eval's arguments")


def parse_lm_eval(words: Sequence[str]) -> argparse.Namespace:
    """``words`` parsed by lm-eval's own parser (it reads ``sys.argv``: set to them for the call, put back after);
    its ``--help`` and its refusals of a bad flag exit as lm-eval's do (SystemExit 0, 2)."""
    from lm_eval._cli import HarnessCLI

    cli = HarnessCLI()
    saved = sys.argv
    sys.argv = ["lm-eval", *words]
    try:
        parsed: argparse.Namespace = cli.parse_args()
        return parsed
    finally:
        sys.argv = saved


def run_lm_eval_command(args: argparse.Namespace) -> int:
    """lm-eval's command, ``args.words``, run with ``--model resumerge`` registered (one API call)."""
    from lm_eval.utils import setup_logging

    from resumerge.api import lm_eval

    words = args.words
    setup_logging()
    try:
        harness = parse_lm_eval(words)
    except SystemExit as exc:  # lm-eval's parser printed its usage (--help: 0) or its one-line refusal (2)
        if exc.code not in (0, None):
            return 2
        if "-h" in words or "--help" in words:  # lm-eval's help, then what it cannot know of resumerge
            print(f"\nresumerge:\n{textwrap.fill(MODEL_HELP, width=79, initial_indent='  ', subsequent_indent='  ')}")
        return EXIT_OK
    lm_eval(harness, command=shlex.join(["resumerge", "lm-eval", *_tokenless(words)]))
    return EXIT_OK


def _tokenless(words: Sequence[str]) -> list[str]:
    """``words`` with any ``token=`` taken out of ``--hf_hub_log_args``: the command that continues an interrupted
    run is printed and kept in the journal's progress file, where a token must never be (lm-eval reads HF_TOKEN
    from the environment when the arguments give none)."""
    flag = "--hf_hub_log_args"
    kept: list[str] = []
    follows = False
    for word in words:
        if follows or word.startswith(f"{flag}="):
            prefix = "" if follows else f"{flag}="
            pairs = [p for p in word.removeprefix(prefix).split(",") if p.split("=", 1)[0].strip() != "token"]
            word = prefix + ",".join(pairs)
        follows = word == flag
        kept.append(word)
    return kept
