"""The merge itself, layer by layer: its methods, its vocabulary, its plan, the engine that runs it and the store that
makes each step durable.

A group: each package here is a layer of its own, with its own ``May import:`` line (tests/test_layout.py holds them
to it; no analysis imports another); this file imports nothing.

- :mod:`.engine`: Execute a plan.
- :mod:`.methods`: Merge methods.
- :mod:`.plan`: Decide first.
- :mod:`.store`: Where committed files go and how resumerge remembers them.
- :mod:`.vocab`: Tokenizer merge.
"""

__all__ = ["engine", "methods", "plan", "store", "vocab"]
