"""The kinds of run besides a merge: LoRA extraction, MoE upcycling, recipes of several stages, the tokenizer
transplant and the evolutionary search.

A group: each package here is a layer of its own, with its own ``May import:`` line (tests/test_layout.py holds them
to it; no analysis imports another); this file imports nothing.

- :mod:`.evolve`: ``resumerge evolve``.
- :mod:`.extract`: LoRA extraction (``resumerge extract-lora``).
- :mod:`.moe`: MoE upcycling.
- :mod:`.recipes`: Multi-stage recipes (mergekit-multi).
- :mod:`.transplant`: Tokenizer transplant (``resumerge tokensurgeon MODEL DONOR OUT``).
"""

__all__ = ["evolve", "extract", "moe", "recipes", "transplant"]
