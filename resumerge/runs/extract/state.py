"""What a LoRA extraction leaves for other commands to read, without torch (``resumerge status`` stays quick): the
mark of its recorded text, and its factor cache's folder and entries — a module's entry is written the moment its
truncation is done and stays until the adapter is committed, so the entries are the modules decomposed.
:mod:`resumerge.runs.extract` writes them; the extraction kind's ``status`` reads them. Standard library only.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path

# The key of an extraction's recorded text (a JSON document; a merge's is YAML).
EXTRACTION_MARK = "extract_lora"
# The factor cache's folder in a run's state folder, and its entries' suffix.
FACTORS_DIR = "extract-factors"
FACTORS_SUFFIX = ".factors"
# The safetensors metadata key naming an entry's module.
MODULE_KEY = "module"

_FACTOR_A = re.compile(r"^base_model\.model\.(.+)\.lora_(?:embedding_)?A(?:\.weight)?$")


def lora_modules(tensor_names: Iterable[str]) -> list[str]:
    """The decomposed modules of an adapter, from its tensor names (each module's factor A), sorted by name (the
    order the adapter's data, and so the extraction, goes in)."""
    return sorted(m.group(1) for m in map(_FACTOR_A.match, tensor_names) if m is not None)


def cached_modules(directory: Path) -> set[str]:
    """The modules with an entry in the factor cache ``directory`` (read from each entry's header)."""
    found: set[str] = set()
    try:
        entries = list(directory.glob("*" + FACTORS_SUFFIX))
    except OSError:
        return found
    for path in entries:
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(length, 1 << 20)))
            module = header.get("__metadata__", {}).get(MODULE_KEY)
        except (OSError, ValueError, struct.error, AttributeError):
            continue  # a temp file being renamed, a damaged entry: not counted
        if isinstance(module, str):
            found.add(module)
    return found
