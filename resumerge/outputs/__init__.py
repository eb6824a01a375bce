"""The output formats: the container a merge is written as (its file layout, side files, fingerprint extras, the
estimate's facts, the card's tags and its integrity rule: :mod:`.containers`), and the encoders of the formats that
only write (GGUF: ``gguf/``, its codec, stacked experts, file layout and tokenizer keys).

The planner picks one container per run and carries it on the plan; nothing outside this package and the format
objects asks which one it has.

May import: errors, config, machine (sizes), inputs.
"""

__all__ = [
    "containers",
    "gguf",
]
