"""The manifest: a small JSON file in OUT that marks the directory as resumerge's and can rebuild a lost ledger.

It holds the config text, options, model directories, fingerprint parts, input identities, the planned file
names, and the size and checksum of every committed file (under the key ``sha256``, its first name: a record naming
its algorithm, :mod:`resumerge.machine.checksums`). It is rewritten atomically after each commit, carries
no timestamps (so a finished OUT is byte-identical whatever the interruptions), and has no checksum of its own:
where the run's ledger is at hand it is judged by it (:mod:`resumerge.merge.store.manifestcheck`), and without it
every file it lists is re-hashed before being trusted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.config.modelref import parse_model_ref
from resumerge.errors import LedgerError

if TYPE_CHECKING:  # a type only: status reads manifests without the sinks' futures and threads
    from resumerge.merge.store.sink import OutputSink

MANIFEST_NAME = "resumerge-manifest.json"
FORMAT = 1

# A hub model's folder as this machine's HF cache holds it (``.../models--org--name/snapshots/<sha>``), and a hub
# model as the manifest publishes it (``org/name@<sha>``: :func:`published_dirs`; both pin the commit on resume).
_CACHE_SNAPSHOT = re.compile(r"models--([^/]+)/snapshots/([0-9a-f]{40})/?$")
PUBLISHED_HUB = re.compile(r"[^/@][^@]*@([0-9a-f]{40})")
_ADAPTER = "#adapter"  # resumerge.inputs.catalog.ADAPTER_SUFFIX: the adapter folder of a ``model+adapter`` input


def published_dirs(model_dirs: Mapping[str, str]) -> dict[str, str]:
    """What a manifest records of a plan's ``model_dirs`` (the folders this machine read, kept in the ledger
    only): a hub model as its repo id at the pinned commit (``org/name@<sha>``), a local one as the config names
    it (relative as typed), so that OUT never holds a machine path and the same merge from another folder writes
    the same bytes. Entries already in that form are kept (a manifest read back and written again)."""
    return {key: _published(key, folder) for key, folder in model_dirs.items()}


def _published(key: str, folder: str) -> str:
    hub = _CACHE_SNAPSHOT.search(folder)
    if hub is not None:
        return f"{hub[1].replace('--', '/')}@{hub[2]}"
    if PUBLISHED_HUB.fullmatch(folder):
        return folder
    model, _, suffix = key.partition("#")
    try:
        ref = parse_model_ref(model)
    except ValueError:  # not a config's reference: the folder's base name alone
        return Path(folder).name
    if "#" + suffix == _ADAPTER and ref.lora is not None:
        return ref.lora.path
    # Another folder a plan reads (a measurement's Grams): the config names it; its base name says which.
    return ref.path if not suffix else Path(folder).name


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest. ``committed`` maps file name -> {"bytes": int, "sha256": str}, the second a checksum's
    record (:mod:`resumerge.machine.checksums`: a bare sha256, or ``xxh3-128:HEX``)."""

    version: str
    fingerprint: str
    parts: Mapping[str, str]
    inputs: Mapping[str, Any]
    options: Mapping[str, Any]
    model_dirs: Mapping[str, str]
    config_text: str
    planned: tuple[str, ...]
    shard_sizes: Mapping[str, int] = field(default_factory=dict)
    shard_tensors: Mapping[str, int] = field(default_factory=dict)
    tensors_total: int = 0
    committed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    state: str = "running"

    def to_bytes(self, published: bool = True) -> bytes:
        """Deterministic JSON (sorted keys, 2-space indent, trailing newline); ``published`` False: ``model_dirs``
        as this machine's folders, as resumerge wrote them before they were published (:func:`published_dirs`)."""
        doc = {
            "format": FORMAT,
            "resumerge_version": self.version,
            "fingerprint": self.fingerprint,
            "parts": dict(self.parts),
            "inputs": dict(self.inputs),
            "options": dict(self.options),
            "model_dirs": published_dirs(self.model_dirs) if published else dict(self.model_dirs),
            "config_text": self.config_text,
            "planned": list(self.planned),
            "shard_sizes": dict(self.shard_sizes),
            "shard_tensors": dict(self.shard_tensors),
            "tensors_total": self.tensors_total,
            "committed": {k: dict(v) for k, v in sorted(self.committed.items())},
            "state": self.state,
        }
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def manifest_path(out_dir: Path) -> Path:
    """Where the manifest of ``out_dir`` lives."""
    return out_dir / MANIFEST_NAME


def read_manifest(out_dir: Path) -> Manifest | None:
    """Read the manifest of ``out_dir``; None if absent. Raises :class:`LedgerError` if it is unreadable."""
    path = manifest_path(out_dir)
    if not path.is_file():
        return None
    return parse_manifest(path.read_bytes(), str(path))


# What decoding bytes that are not a manifest this resumerge wrote raises (:func:`decode_manifest`).
DECODE_ERRORS = (ValueError, KeyError, TypeError, AttributeError)


def decode_manifest(data: bytes) -> Manifest:
    """The manifest in ``data``; raises one of :data:`DECODE_ERRORS` (a UnicodeDecodeError is a ValueError) when
    they are not a manifest this resumerge can read."""
    doc = json.loads(data.decode("utf-8"))
    if doc.get("format") != FORMAT:
        raise ValueError(f"unknown manifest format {doc.get('format')!r}")
    return Manifest(
        version=str(doc["resumerge_version"]),
        fingerprint=str(doc["fingerprint"]),
        parts=dict(doc["parts"]),
        inputs=dict(doc["inputs"]),
        options=dict(doc["options"]),
        model_dirs=dict(doc["model_dirs"]),
        config_text=str(doc["config_text"]),
        planned=tuple(doc["planned"]),
        shard_sizes={str(k): int(v) for k, v in doc["shard_sizes"].items()},
        shard_tensors={str(k): int(v) for k, v in doc["shard_tensors"].items()},
        tensors_total=int(doc["tensors_total"]),
        committed={str(k): dict(v) for k, v in doc["committed"].items()},
        state=str(doc.get("state", "running")),
    )


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse manifest bytes read from ``where`` (a path or a hub URL, for the message).

    Raises :class:`LedgerError` if they are not a manifest this resumerge can read.
    """
    try:
        return decode_manifest(data)
    except DECODE_ERRORS as exc:
        # Damage or another tool's file: either way it is the only record of the run where no ledger is at hand
        # (where one is, the run rewrites it: resumerge.merge.store.manifestcheck), and nothing it lists can be trusted.
        raise LedgerError(
            f"the manifest {where} is damaged or was not written by this resumerge ({exc})",
            path=where,
            hint="without the run's ledger nothing in OUT can be checked: pass the --state-dir the run used if it "
                 "is elsewhere, else merge into a new output directory",
        ) from None


@dataclass
class ManifestBook:
    """The manifest being kept up to date: rewritten atomically after every commit."""

    sink: OutputSink
    manifest: Manifest

    def commit(self, name: str, size: int, sha256: str) -> None:
        """Record ``name`` as committed and rewrite the manifest."""
        committed = dict(self.manifest.committed)
        committed[name] = {"bytes": size, "sha256": sha256}
        self._store(committed, self.manifest.state)

    def drop(self, name: str) -> None:
        """Forget a committed file (it is being rebuilt)."""
        committed = {k: v for k, v in self.manifest.committed.items() if k != name}
        self._store(committed, self.manifest.state)

    def set_state(self, state: str) -> None:
        """Rewrite the manifest with ``state`` (running|done)."""
        self._store(dict(self.manifest.committed), state)

    def _store(self, committed: dict[str, Mapping[str, Any]], state: str) -> None:
        self.manifest = replace(self.manifest, committed=committed, state=state)
        self.sink.replace_small(MANIFEST_NAME, self.manifest.to_bytes())
