"""The tokenizer files of a GGUF model (tokenizer.json, tokenizer_config.json with the chat template), rebuilt
from its ``tokenizer.*`` metadata by transformers' GGUF tokenizer converter, and kept in the installation's cache.

transformers is optional (the ``[check]`` extra): it is imported only when a GGUF model's tokenizer is copied to a
safetensors output; without it that is refused in one line before anything is written (``--no-copy-tokenizer``
merges without a tokenizer).

A rebuild costs the import of transformers and its parse of the whole metadata (SmolLM2's 49,152 tokens and 48,900
merges: about 8 CPU seconds, more for larger vocabularies), paid again by every ``plan`` and ``run`` of the same
file. transformers is given the file's key-values alone (:func:`~.header.metadata_only`, under one fixed name, but a
split set's counts), never its tensor infos nor its name, so the files are a function of those key-values and the
versions of the code that makes them, whatever file they came from (another encoding of the same model, the same
model under another name or split: one rebuild). transformers reads tensor names only to build the model's config
(tied embeddings, a few families' biases), which the tokenizer files do not hold: the files of SmolLM2's GGUF and of
the tests' tiny ones are the same bytes either way. Kept under :func:`~resumerge.config.locations.cache_root` by
that key, with a digest of their own, they are rebuilt only when one of those changed or the kept copy does not
match its digest (a torn or edited cache file is never used).

May import: errors, config, inputs.gguf.header.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.metadata
import json
import tempfile
from pathlib import Path

from resumerge.config.locations import kept_file, replace_text
from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.header import GgufHeader, metadata_only

# The cache's folder under the cache root, and its files' layout (a change here names new files).
_FOLDER = "gguf-tokenizers"
_FORMAT = 2
# The name the key-values are given to transformers under (nothing it writes depends on it), and the keys left out:
# a split set's (which file of how many: transformers' converter reads none of them), so a split set's first file
# and the same model in one file take one rebuild.
_METADATA_NAME = "model.gguf"
_LEFT_OUT = ("split.",)
# The distributions whose code makes the files: the converter, the library that writes tokenizer.json, the reader
# the converter parses the metadata with.
_MAKERS = ("transformers", "tokenizers", "gguf")


def gguf_tokenizer_files(path: Path, header: GgufHeader | None = None,
                         cache_dir: Path | None = None) -> dict[str, bytes]:
    """The tokenizer files of the GGUF at ``path``, by name, as transformers writes them. Given its parsed
    ``header`` (a file on disk, or a hub GGUF read by range), transformers is given a GGUF of its key-values alone
    (:func:`~.header.metadata_only`, in a temporary folder), never its tensors, and the files are taken from the
    cache in ``cache_dir`` (default
    :func:`~resumerge.config.locations.cache_root`) when an earlier rebuild kept them, and kept there after a
    rebuild. Raises :class:`ModelInputError` when transformers is missing or cannot rebuild the tokenizer."""
    metadata = None if header is None else metadata_only(header, _LEFT_OUT)  # what transformers reads, once
    kept = None if metadata is None else _kept_path(metadata, cache_dir)
    if kept is not None:
        found = _read(kept)
        if found is not None:
            return found
    files = _rebuilt(path, metadata)
    if kept is not None:
        with contextlib.suppress(OSError):  # a cache: not kept costs a rebuild next time, nothing else
            _write(kept, files)
    return files


def _rebuilt(path: Path, metadata: bytes | None) -> dict[str, bytes]:
    """The files as transformers rebuilds them now from ``metadata`` (a GGUF of the key-values alone; the file at
    ``path`` itself only without it), in a process of its own (:data:`_REBUILD`): transformers' tokenization
    modules (about 100 MB) never stay in the process that asked, a run whose budget counts no transformers (its
    importance pass on a first run measured 480 MB under a 362 MB budget so)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("transformers") is None:
        raise ModelInputError("rebuilding a GGUF model's tokenizer needs transformers, which is not installed",
                              path=str(path), hint="pip install transformers (in the resumerge clone: pip install -c "
                                                   "constraints.txt -e '.[check,gguf]'), or merge with "
                                                   "--no-copy-tokenizer")
    with tempfile.TemporaryDirectory(prefix="resumerge-gguf-tokenizer-") as scratch:
        read = path
        if metadata is not None:
            read = Path(scratch) / "metadata" / _METADATA_NAME
            read.parent.mkdir()
            read.write_bytes(metadata)
        out = Path(scratch) / "out"
        done = subprocess.run([sys.executable, "-c", _REBUILD, json.dumps(sys.path), str(read), str(out)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            raise ModelInputError(f"transformers cannot rebuild this GGUF's tokenizer ({lines[-1] if lines else ''})",
                                  path=str(path),
                                  hint="merge with --no-copy-tokenizer and add the tokenizer files by hand")
        return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


# The rebuild, in a fresh interpreter with the caller's import path: never the network (the file is local), and the
# same bytes whatever HF_HUB_OFFLINE says (transformers records the flag in tokenizer_config.json, which the plan
# hashes). The tokenizers library raises a bare Exception for a vocabulary it cannot build: its message is the last
# line the caller reads.
_REBUILD = ("import json, sys\nsys.path[:] = json.loads(sys.argv[1])\nfrom pathlib import Path\n"
            "from transformers import AutoTokenizer\nread = Path(sys.argv[2])\n"
            "try:\n    tokenizer = AutoTokenizer.from_pretrained(str(read.parent), gguf_file=read.name, "
            "local_files_only=True)\nexcept Exception as exc:\n    sys.exit(str(exc).replace(chr(10), ' '))\n"
            "tokenizer.save_pretrained(sys.argv[3])\n")


def _kept_path(metadata: bytes, cache_dir: Path | None) -> Path | None:
    """Where the files rebuilt from ``metadata`` (the key-values transformers is given, :func:`_rebuilt`: whatever
    file holds them) are kept; None without transformers (nothing to key them by: the rebuild says what is
    missing)."""
    versions: list[str | None] = []
    for name in _MAKERS:
        try:
            versions.append(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            if name == "transformers":
                return None
            versions.append(None)
    return kept_file(_FOLDER, [_FORMAT, versions, hashlib.sha256(metadata).hexdigest()],
                     cache_dir=cache_dir)


def _read(kept: Path) -> dict[str, bytes] | None:
    """The kept files, or None when there are none or they do not match their digest."""
    try:
        doc = json.loads(kept.read_text(encoding="utf-8"))
        files = {str(name): base64.b64decode(data, validate=True) for name, data in doc["files"].items()}
        return files if doc["sha256"] == _digest(files) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or torn: rebuilt
        return None


def _write(kept: Path, files: dict[str, bytes]) -> None:
    doc = {"sha256": _digest(files), "files": {name: base64.b64encode(data).decode() for name, data in files.items()}}
    replace_text(kept, json.dumps(doc))


def _digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name, data in sorted(files.items()):
        digest.update(hashlib.sha256(name.encode()).digest() + hashlib.sha256(data).digest())
    return digest.hexdigest()
