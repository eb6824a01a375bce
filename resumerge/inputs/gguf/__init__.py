"""GGUF files (llama.cpp's format) as model inputs: the header parser, the names and metadata of each family as
Hugging Face's, the model a GGUF file is, its codec and its tokenizer.

``header`` parses a GGUF's header; ``names`` maps its tensor names and metadata to Hugging Face's (per family);
``model`` opens a file (or split set) as a model input's config and tensors; ``codec`` decodes its tensors
(F16, BF16, Q8_0, the legacy and two K types with torch: ``blocks``, ``legacy``; the other types with gguf-py,
an optional dependency: ``[gguf]``); ``tokenizer`` rebuilds the tokenizer files from its metadata.
"""

from resumerge.inputs.gguf.model import INSTALL, METHOD, GgufModel, open_gguf

__all__ = ["INSTALL", "METHOD", "GgufModel", "open_gguf"]
