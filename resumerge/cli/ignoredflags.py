"""mergekit's command-line flags that resumerge accepts so that existing command lines work, and why each is not
needed: hidden from ``--help``, and one note on stderr for each one given (``unneeded_*`` dests, which the front
door's parity test leaves out of the API's keyword arguments).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from types import MappingProxyType

# mergekit-yaml flags that resumerge accepts so existing command lines work, and why each is not needed.
UNNEEDED_FLAGS: Mapping[str, str] = MappingProxyType({
    "--no-cuda": "merges run on the CPU unless --device cuda is given",
    "--lazy-unpickle": ".bin checkpoints are always read tensor by tensor through PyTorch's weights-only loader",
    "--no-lazy-unpickle": ".bin checkpoints are always read tensor by tensor through PyTorch's weights-only loader",
    "--no-allow-crimes": "mixing architectures is refused by default",
    "--no-unsafe-truncate-embeddings": "vocabulary mismatches are refused by default",
    "--no-clone-tensors": "output tensors never share memory here",
    "--no-low-cpu-memory": "memory is bounded by streaming shards to disk",
    "--no-read-to-gpu": "inputs are read to the host by default",
    "--no-multi-gpu": "one device is used",
    "--no-async-write": "writes always overlap computation",
    "--no-trust-remote-code": "resumerge never executes code from model repositories",
    "--no-safe-serialization": "output is always safetensors (resumerge never writes pickles)",
    "--no-quiet": "progress is shown by default",
    "--clone-tensors": "output tensors never share memory here",
    "--low-cpu-memory": "memory is bounded by streaming shards to disk",
    "--read-to-gpu": "with --device cuda each unit's inputs are moved to the GPU as they are read",
    "--multi-gpu": "one GPU is used (--device cuda:N picks which)",
    "--gpu-rich": "GPU work in flight follows --max-gpu-memory",
    "--async-write": "writes always overlap computation",
    "--copy-tokenizer": "the tokenizer is copied by default",
    "--safe-serialization": "output is always safetensors",
    "--write-model-card": "README.md and mergekit_config.yml are written by default",
    "--trust-remote-code": "resumerge never executes code from model repositories",
    "--verbose": "progress is shown by default",
    # mergekit-moe's: it quantises the whole base model to fit the hidden-state routers in memory.
    "--load-in-4bit": "MoE routers are computed one decoder layer at a time within --max-memory",
    "--load-in-8bit": "MoE routers are computed one decoder layer at a time within --max-memory",
})
UNNEEDED_WITH_VALUE: Mapping[str, str] = MappingProxyType({
    "--write-threads": "one writer thread streams every shard",
    "--lora-merge-cache": "no merge cache is needed",
    "--lora-merge-dtype": "no merge cache is needed",
})
# mergekit-extract-lora's flags that mean nothing for an adapter, beyond those above (its other options are real).
EXTRACT_UNNEEDED: Mapping[str, str] = MappingProxyType({
    "--copy-tokenizer": "an adapter holds no tokenizer files",
    "--no-copy-tokenizer": "an adapter holds no tokenizer files",
    "--no-allow-crimes": "modules are matched by name and shape",
    "--no-unsafe-truncate-embeddings": "vocabulary mismatches are refused by default",
    "--write-model-card": "README.md is written by default",
})
EXTRACT_UNNEEDED_WITH_VALUE: Mapping[str, str] = MappingProxyType({
    "--out-shard-size": "the adapter is written as one file",
})


def accept_ignored(p: argparse.ArgumentParser, flags: Mapping[str, str], with_value: Mapping[str, str]) -> None:
    """Accept mergekit's flags that ``p`` has no use for (hidden from its help; :func:`note_ignored` notes each
    one given), skipping any that ``p`` already defines with a meaning."""
    taken = {opt for action in p._actions for opt in action.option_strings}
    for flag in flags.keys() - taken:
        p.add_argument(flag, action="store_true", dest=dest_of(flag), help=argparse.SUPPRESS)
    for flag in with_value.keys() - taken:
        p.add_argument(flag, dest=dest_of(flag), default=None, help=argparse.SUPPRESS)
    if "-v" not in taken:
        p.add_argument("-v", action="count", default=0, dest="v_flag", help=argparse.SUPPRESS)


def dest_of(flag: str) -> str:
    return "unneeded_" + flag.lstrip("-").replace("-", "_")


def note_ignored(args: argparse.Namespace) -> None:
    """One note on stderr per mergekit flag given that this command accepts only to ignore it."""
    every = {**UNNEEDED_FLAGS, **UNNEEDED_WITH_VALUE}
    if args.command == "extract-lora":
        every |= {**EXTRACT_UNNEEDED, **EXTRACT_UNNEEDED_WITH_VALUE}
    for flag, why in every.items():
        value = getattr(args, dest_of(flag), None)
        if value not in (None, False) and not args.quiet:
            print(f"note: {flag} is not needed by resumerge ({why}); ignored", file=sys.stderr)
