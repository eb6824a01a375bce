"""The tokenizer files of a GGUF model (tokenizer.json, tokenizer_config.json with the chat template), rebuilt
from its ``tokenizer.*`` metadata by transformers' GGUF tokenizer converter.

transformers is optional (the ``[check]`` extra): it is imported only when a GGUF model's tokenizer is copied to a
safetensors output; without it that is refused in one line before anything is written (``--no-copy-tokenizer``
merges without a tokenizer).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.header import GgufHeader, metadata_only


def gguf_tokenizer_files(path: Path, header: GgufHeader | None = None) -> dict[str, bytes]:
    """The tokenizer files of the GGUF at ``path``, by name, as transformers writes them. A file not on disk (a hub
    GGUF read by range) is read from its parsed ``header``: transformers is given a GGUF of its key-values alone
    (:func:`~.header.metadata_only`, under the same name in a temporary folder), never its tensors."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ModelInputError("rebuilding a GGUF model's tokenizer needs transformers, which is not installed",
                              path=str(path), hint="pip install transformers (in the resumerge clone: pip install -c "
                                                   "constraints.txt -e '.[check,gguf]'), or merge with "
                                                   "--no-copy-tokenizer") from None
    with tempfile.TemporaryDirectory(prefix="resumerge-gguf-tokenizer-") as scratch:
        read = path
        if not path.is_file() and header is not None:
            read = Path(scratch) / "metadata" / path.name
            read.parent.mkdir()
            read.write_bytes(metadata_only(header))
        try:
            # Never the network (the file is local), and the same bytes whatever HF_HUB_OFFLINE says: transformers
            # records the flag in tokenizer_config.json, and the plan hashes that file.
            tokenizer = AutoTokenizer.from_pretrained(str(read.parent), gguf_file=read.name, local_files_only=True)
        # The tokenizers library raises a bare Exception for a vocabulary it cannot build (a merge of unknown tokens).
        except Exception as exc:
            raise ModelInputError(f"transformers cannot rebuild this GGUF's tokenizer ({exc})", path=str(path),
                                  hint="merge with --no-copy-tokenizer and add the tokenizer files by hand") from None
        out = Path(scratch) / "out"
        tokenizer.save_pretrained(out)
        return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
