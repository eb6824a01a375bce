"""Decide first: turn a config and the input headers into a frozen, fingerprinted plan of every output file and tensor,
before a weight is read.

Pure: the planner reads configs and headers, never weights, and writes nothing. Architecture families, the
output config.json, shard layout and the memory cost of each unit are decided here.

May import: errors, config, memory, methods, vocab, inputs.
"""

__all__ = [
    "architecture",
    "fetching",
    "merge_plan",
    "module_views",
    "modules",
    "outconfig",
    "parameters",
    "planner",
    "sharding",
    "tokenizer_plan",
    "truncation",
    "workunits",
]
