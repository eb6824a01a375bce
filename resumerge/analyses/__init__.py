"""The analyses: what resumerge learns from models by running them, beside the merge kinds that write them.

:mod:`.check` (does a merge work: its static pass, its layer-streamed forward pass over the merge, its base and its
parents, and the verdict) and :mod:`.measure` (the Gram matrices of every linear's input for the data-aware merges)
run on the layer-streamed forward engine (:mod:`resumerge.forward`); each keeps its own journal under the state dir
and answers ``resumerge status`` for the folders it writes. They are grouped here because they share the engine,
the prompts and the model openers, and the tree should say so; each subpackage's docstring names what it uses.

May import: errors, config, forward, inputs, memory, methods, store, engine, vocab, outputs, torch_import.
"""

__all__ = ["check", "importance", "measure"]
