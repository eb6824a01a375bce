"""Decide first: turn a config and the input headers into a frozen, fingerprinted plan of every output file and tensor,
before a weight is read.

Pure: the planner reads configs and headers, never weights, and writes nothing but resumerge's cache of what
transformers answered about a config (``keptfacts``). Architecture families, the output config.json, shard layout
and the memory cost of each unit are decided here; the side files of an output (``sidefiles``, ``modelcard``) are
pure functions of the plan.

May import: errors, config, machine, merge.methods, merge.vocab, inputs, outputs.
"""

__all__ = [
    "architecture",
    "cardwording",
    "fetching",
    "merge_plan",
    "modelcard",
    "module_views",
    "modules",
    "options",
    "outconfig",
    "parameters",
    "placing",
    "planner",
    "sharding",
    "sidefiles",
    "tokenizer_plan",
    "truncation",
    "workunits",
]
