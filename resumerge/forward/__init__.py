"""The layer-streamed forward engine: a model's modules built without weights, each decoder layer given its weights
(read through the codecs) only while it runs. The modules are transformers' own for the model's architecture, or, for
the common dense families (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3's text model), :mod:`.native`'s,
which compute the same numbers to the bit without importing transformers (a fresh process's start, paid again by
every resumed pass, 2.5 s shorter).

One engine for every forward pass resumerge runs: the hidden-state gates of a mergekit-moe config
(:mod:`resumerge.moe.forward`) and ``resumerge check`` (:mod:`resumerge.analyses.check`). :mod:`.reader` reads a model's
logical tensors (plain or quantized) in the compute dtype, :mod:`.stream` builds the modules and runs the
embeddings, one decoder layer, and the final norm with the head (logits), :mod:`.native` builds the common
families' modules, and :mod:`.journal` saves the hidden states after a layer durably (temp file, fsync, rename) and
finds where a killed pass resumes. transformers is imported only inside the functions that need it, in the process
that runs the pass, and only where :mod:`.native` does not build the modules.

May import: errors, inputs, plan (inputrefs only).
"""

from __future__ import annotations

from resumerge.forward.journal import durable_save
from resumerge.forward.reader import CastReader, Location, Weights, base_formats, pass_bytes

__all__ = ["CastReader", "Location", "Weights", "base_formats", "durable_save", "pass_bytes"]
