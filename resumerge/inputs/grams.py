"""A Gram measurement on disk, as ``resumerge measure`` writes it and a ``regmean`` merge reads it.

One folder (``resumerge measure``'s OUT_DIR) holds, per model of the measured config, one safetensors file per
decoder layer (``model-00/layer-00003.safetensors``) with the float32 Gram matrix (the mean of x·xᵀ over every token
position) of each distinct input of the layer's linears: q/k/v share one input and gate/up another, so a Llama
layer's file holds four, each stored under the first linear that reads it; the file's metadata maps every linear
to the tensor holding its Gram. ``measure.json``, written last, is the manifest: each model's folder, its weight
files' identities (so a merge finds a model's Grams however its path is written), the token count, every linear's
Gram (file, tensor, shape) and every file's sha256, so a merge refuses a Gram that changed since it was measured.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.errors import ConfigError

MANIFEST = "measure.json"
FORMAT = "resumerge-grams"
VERSION = 1
LAYER_PREFIX = "layer-"
# The one metadata key of a layer file (one: safetensors writes several in an order that varies between processes):
# JSON {"inputs": {linear module name: tensor key holding its Gram}, "tokens": the token count}.
METADATA_KEY = "resumerge.grams"

FileIdentity = tuple[str, int, str]


@dataclass(frozen=True)
class GramRef:
    """Where one linear's Gram is: ``file`` (relative to the measurement folder), ``tensor`` in it, ``size`` n."""

    file: str
    tensor: str
    size: int


@dataclass(frozen=True)
class MeasuredModel:
    """One model's Grams: its ``key`` and ``path`` in the measured config, its weight ``files`` (name, size,
    identity), the ``tokens`` measured, its ``grams`` by linear module name and each file's ``sha256``."""

    key: str
    path: str
    files: tuple[FileIdentity, ...]
    tokens: int
    grams: dict[str, GramRef]
    sha256: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "path": self.path, "files": [list(f) for f in self.files], "tokens": self.tokens,
                "grams": {name: [g.file, g.tensor, g.size] for name, g in sorted(self.grams.items())},
                "sha256": dict(sorted(self.sha256.items()))}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> MeasuredModel:
        return cls(str(doc["key"]), str(doc["path"]), tuple((str(n), int(s), str(i)) for n, s, i in doc["files"]),
                   int(doc["tokens"]), {name: GramRef(str(f), str(t), int(n)) for name, (f, t, n)
                                        in doc["grams"].items()}, {str(k): str(v) for k, v in doc["sha256"].items()})


@dataclass(frozen=True)
class Measurement:
    """A finished measurement: its ``models`` in config order, the ``texts_sha256`` of the token sequences."""

    models: tuple[MeasuredModel, ...]
    sequences: int
    texts_sha256: str
    # RegMean++'s Grams (each layer's from the merged model's earlier layers): the method and the off-diagonal
    # ratio the merge of those layers used (they hold only for that merge); None: each model's own forward.
    merged: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {"format": FORMAT, "version": VERSION, "sequences": self.sequences,
               "texts_sha256": self.texts_sha256, "models": [m.to_json() for m in self.models]}
        if self.merged is not None:
            doc["merged"] = self.merged
        return doc

    def find(self, files: tuple[FileIdentity, ...]) -> MeasuredModel | None:
        """The measured model whose weight files are ``files`` (by name, size and content identity)."""
        return next((m for m in self.models if m.files == files), None)


def model_folder(index: int) -> str:
    """The folder of the ``index``-th measured model's layer files."""
    return f"model-{index:02d}"


def layer_file(index: int, layer: int) -> str:
    """The file of layer ``layer`` of the ``index``-th model, relative to the measurement folder."""
    return f"{model_folder(index)}/{LAYER_PREFIX}{layer:05d}.safetensors"


def sha256_of(path: Path) -> str:
    """The sha256 of the file at ``path``, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_measurement(folder: Path, *, yaml_path: str = "parameters.grams") -> Measurement:
    """The finished measurement in ``folder``; raises :class:`ConfigError` naming ``yaml_path`` when there is none
    (no folder, an unfinished measurement) or its manifest is not one."""
    path = folder / MANIFEST
    hint = f"run: resumerge measure CONFIG {folder} (it resumes where a stopped one left off)"
    if not folder.is_dir():
        raise ConfigError(f"the Gram folder {folder} does not exist", yaml_path=yaml_path, hint=hint)
    if not path.is_file():
        raise ConfigError(f"{folder} holds no finished Gram measurement ({MANIFEST} is missing)",
                          yaml_path=yaml_path, hint=hint)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} manifest")
        return Measurement(tuple(MeasuredModel.from_json(m) for m in doc["models"]), int(doc["sequences"]),
                           str(doc["texts_sha256"]), doc.get("merged"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a Gram manifest resumerge can read: {exc}", yaml_path=yaml_path,
                          hint=hint) from None
