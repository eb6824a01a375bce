"""The token sequences a pass runs and how they go through the layers: the built-in texts, a prompts file and the
context rule, the one tokenizer loader (:mod:`.texts`; the tokenizer read without transformers where it can be,
:mod:`.plaintok`), a check's sequences remembered (:mod:`.tokens`), how models whose vocabularies differ meet over
the tokens they share (:mod:`.vocabs`), and the batches, padded on the right to the longest of each
(:mod:`.batches`).

May import: errors, config, inputs, machine, merge.vocab, forward.engine (the "is transformers here" check).
"""

__all__ = [
    "batches",
    "plaintok",
    "texts",
    "tokens",
    "vocabs",
]
