"""The parents the streamed-evaluation benches merge (``bench_evolve``, ``bench_unwritten``): three generated
Llama-style float32 models, base, a and b (seeds 1, 2, 3), of the shape ``--layers``, ``--hidden``,
``--intermediate`` and ``--vocab`` give (by default a 6-layer, 768-wide model of a 16,000-token vocabulary), a head
per 64 of the width and a key-value head per 256, in one shard."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from resumerge.cli.modelgen import ModelSpec


def add_shape(parser: argparse.ArgumentParser) -> None:
    """The parents' shape flags, on ``parser``."""
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16000)


def made(paths: Sequence[Path], args: argparse.Namespace) -> tuple[ModelSpec, list[Path]]:
    """The parents' spec, of ``args``' shape, and those of base, a and b (``paths``, in that order) that were not
    there yet, made now (a folder with a config.json is taken as made)."""
    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, vocab=args.vocab,
                     heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 256), shard_bytes=1 << 30)
    new = []
    for seed, path in enumerate(paths, start=1):
        if not (path / "config.json").is_file():
            make_model(path, spec, seed=seed)
            new.append(path)
    return spec, new
