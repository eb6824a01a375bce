"""The side files of an output: the shard index, config.json, the config as YAML, the model card and the tokenizer
files, each a pure function of the plan.

May import: errors, config, vocab, inputs, methods (the card), plan.
"""

__all__ = [
    "aux",
    "modelcard",
]
