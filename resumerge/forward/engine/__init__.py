"""The layer-streamed forward engine: a model's modules built without weights (:mod:`.built`: transformers' own for the
model's architecture, or, for the common dense families, :mod:`.native`'s, which compute the same numbers to the bit
without importing transformers), each decoder layer given its weights, read through the codecs in the compute dtype
(:mod:`.reader`), only while it runs (:mod:`.stream`); whether a layer gives a padded batch's sequences what it gives
each alone (:mod:`.padding`).

A pass's "layers" are the forward's decoder-layer calls in its order (:mod:`.calls`: a forward that loops some
layers calls them several times, each call a step of the pass), from one list of layers or several
(:mod:`.layerlists`), with what a layer hands a later one (:mod:`.handed`), the stand-ins that record the calls
(:mod:`.standins`) and what the base model does after its layers (:mod:`.tail`). Where the layers run, the CPU or
one GPU with its budget (:mod:`.device`); the one "is transformers here" check (:mod:`.requires`). transformers is
imported only inside the functions that need it.

May import: errors, inputs, machine, merge.plan (input references only).
"""

__all__ = [
    "built",
    "calls",
    "device",
    "handed",
    "layerlists",
    "multimodal",
    "native",
    "onmeta",
    "padding",
    "reader",
    "requires",
    "standins",
    "stream",
    "tail",
]
