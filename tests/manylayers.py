"""A many-tensor model for run, kill, resume, status and verify at scale (issue 45): a Llama with thousands of tiny
layers (9 tensors each, 8-wide), so that per-tensor costs, not bytes, decide the wall. The tests build ~2k layers;
``bench/bench_many_tensors.py`` builds 10,000 (90,003 tensors) with the same function."""

from __future__ import annotations

from pathlib import Path

from resumerge.cli.modelgen import ModelSpec, make_model
from tests.support import linear_config, write_config


def many_layer_spec(layers: int) -> ModelSpec:
    """A Llama of ``layers`` tiny layers: 9 tensors a layer (plus embeddings, norm, head), about 1.2 kB a layer in
    float32, input shards of 4 MB."""
    return ModelSpec(layers=layers, hidden=8, intermediate=8, vocab=16, heads=2, kv_heads=1, shard_bytes=4_000_000,
                     tokenizer=False)


def many_layer_merge(root: Path, layers: int) -> Path:
    """Two ``layers``-layer models under ``root`` (a, b) and a linear config over them; returns the config's path."""
    spec = many_layer_spec(layers)
    a = make_model(root / "a", spec, seed=1)
    b = make_model(root / "b", spec, seed=2)
    return write_config(root / "merge.yml", linear_config(a, b, weights=([0.2, 0.8], 0.5)))
