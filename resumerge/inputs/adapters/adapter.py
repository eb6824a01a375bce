"""Open a PEFT LoRA adapter folder without reading its weights: what it changes in the base, and where.

:func:`open_adapter` reads ``adapter_config.json`` and the safetensors header of ``adapter_model.safetensors``
(strictly, like every input) and returns an :class:`Adapter`: for each base tensor the adapter changes, the
locations of its two factors and its scale (:class:`LoraTarget`), the full tensors it replaces, and the
tokenizer files it ships. A pickle-only adapter (``adapter_model.bin``) is refused and never opened.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.errors import ModelInputError, ResumergeError
from resumerge.inputs.adapters.names import Factor, FullTensor, classify
from resumerge.inputs.adapters.settings import CONFIG_NAME, LoraSettings, read_settings
from resumerge.inputs.files import (
    TOKENIZER_FILES,
    InputFile,
    TensorSource,
    contained,
    file_identity,
    file_look,
    followed,
)
from resumerge.inputs.safetensors_format import Header, read_header

WEIGHTS_NAME = "adapter_model.safetensors"
_PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
_DIGEST_VERSION = b"resumerge-lora-adapter-1\n"


@dataclass(frozen=True)
class LoraTarget:
    """How an adapter changes one base tensor: ``W + scale · ΔW`` with ``ΔW = B @ A`` (or its transpose).

    ``a`` / ``b`` locate the factors in the adapter's weights file (``file`` relative to the adapter folder,
    ``entry`` with the safetensors dtype, shape and absolute byte range). For a linear layer ``a`` is
    ``(rank, in)`` and ``b`` ``(out, rank)``; for an embedding ``a`` is ``(rank, num_embeddings)`` and ``b``
    ``(embedding_dim, rank)``. ``fan_in_fan_out`` means ``ΔW = (B @ A)ᵀ``: true for GPT-2 style ``Conv1D``
    layers (their weight is stored ``(in, out)``) and for every embedding. ``embedding`` selects PEFT's
    embedding merge, which rounds ``scale · ΔW`` to the weight's dtype before adding it (a linear layer adds it
    unrounded). ``scale`` is ``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA). Pass these fields to
    :func:`resumerge.inputs.adapters.apply_lora` / :func:`~resumerge.inputs.adapters.apply_lora_rows`.
    """

    module: str
    a: TensorSource
    b: TensorSource
    rank: int
    alpha: float
    scale: float
    fan_in_fan_out: bool
    embedding: bool

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The shape the base tensor must have: ``(out, in)``, or ``(in, out)`` under ``fan_in_fan_out``."""
        rows, cols = self.b.entry.shape[0], self.a.entry.shape[1]
        return (cols, rows) if self.fan_in_fan_out else (rows, cols)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter opened for planning; every field is derived from the folder's files, nothing is loaded.

    ``targets`` maps base tensor names (``model.layers.0.self_attn.q_proj.weight``) to how the adapter changes
    them. ``replacements`` maps base tensor names to full tensors in the adapter file that take the base's place
    (``modules_to_save`` copies, trained biases, saved embedding matrices); as PEFT loads them into the base
    model's parameters, a replacement must be cast to the base tensor's dtype before use, and where a name is
    both replaced and targeted the LoRA delta is added to the replacement. ``files`` is the weights file with
    its content identity; ``tokenizer`` lists ``(name, sha256)`` of the tokenizer, chat-template and generation
    config files shipped in the folder (mergekit ignores them — its defect 5 — but the merged model should use
    the adapter's tokenizer when it has one: see :attr:`has_tokenizer`).
    """

    directory: Path
    config: Mapping[str, Any]
    config_sha256: str
    files: tuple[InputFile, ...]
    targets: Mapping[str, LoraTarget]
    replacements: Mapping[str, TensorSource]
    tokenizer: tuple[tuple[str, str], ...]

    @property
    def tokenizer_files(self) -> tuple[str, ...]:
        """Names of the tokenizer / chat template / generation config files in the adapter folder."""
        return tuple(name for name, _ in self.tokenizer)

    @property
    def has_tokenizer(self) -> bool:
        """Whether the folder holds a usable tokenizer: ``tokenizer_config.json`` plus ``tokenizer.json`` or
        ``tokenizer.model`` (mergekit's condition for copying a tokenizer as files)."""
        names = set(self.tokenizer_files)
        return "tokenizer_config.json" in names and bool(names & {"tokenizer.json", "tokenizer.model"})

    @property
    def digest(self) -> str:
        """sha256 over the config bytes, the weights file's identity and the tokenizer files' hashes.

        Any change to what the merge would read from the adapter changes it; use it in plan fingerprints.
        """
        h = hashlib.sha256(_DIGEST_VERSION)
        h.update(f"config {self.config_sha256}\n".encode())
        for f in self.files:
            h.update(f"file {f.name} {f.size} {f.identity}\n".encode())
        for name, sha in self.tokenizer:
            h.update(f"tokenizer {name} {sha}\n".encode())
        return h.hexdigest()


def open_adapter(directory: Path, *, yaml_path: str) -> Adapter:
    """Open the PEFT LoRA adapter in ``directory`` (reading ``adapter_config.json`` and one safetensors header).

    Raises :class:`ModelInputError` (exit 2, one line naming the file, tensor and ``yaml_path``) for a missing
    folder, config or weights file, a pickle-only adapter (never unpickled), a non-LoRA ``peft_type``, refused
    options (DoRA, LoRA bias, base-rewriting inits, ...), unknown tensor names, factors that are not 2-D floats,
    a factor without its partner, and factor shapes that disagree with each other or with the rank the config
    gives the module (``r`` / ``rank_pattern``); :class:`~resumerge.errors.HostileFileError` for a lying
    safetensors header or a file that links outside the folder.
    """
    try:
        return _open(directory.absolute(), yaml_path)
    except ResumergeError as exc:
        if not exc.yaml_path:  # header and link checks know the file, not the YAML: keep both in the line
            if exc.path and exc.path not in exc.message:
                exc.message = f"{exc.path}: {exc.message}"
                exc.args = (exc.message,)
            exc.yaml_path = yaml_path
        raise


def _open(directory: Path, yaml_path: str) -> Adapter:
    if not directory.is_dir():
        raise ModelInputError(f"LoRA adapter {directory} not found: no such directory", yaml_path=yaml_path,
                              path=str(directory))
    config_path = contained(directory, CONFIG_NAME)
    if not config_path.is_file():
        looks_like_model = (directory / "config.json").is_file()
        raise ModelInputError(
            f"{directory} has no {CONFIG_NAME}, so it is not a PEFT adapter", yaml_path=yaml_path,
            path=str(directory),
            hint="it looks like a full model: reference it without '+'" if looks_like_model else None,
        )
    settings, config, raw = read_settings(config_path, yaml_path=yaml_path)
    weights = followed(directory, WEIGHTS_NAME)  # read as tensors, never copied: a link anywhere is followed
    if not weights.is_file():
        pickles = [name for name in _PICKLE_NAMES if (directory / name).exists()]
        raise ModelInputError(
            f"{directory} has no {WEIGHTS_NAME}"
            + (f", only {pickles[0]} (a pickle, which resumerge never loads)" if pickles else ""),
            yaml_path=yaml_path, path=str(directory),
            hint="re-save it with PEFT's save_pretrained(..., safe_serialization=True)" if pickles else None,
        )
    seen = file_look(weights)  # before its header: a write after this shows as another look
    header = read_header(weights)
    targets, replacements = _read_tensors(header, settings, weights, yaml_path)
    tokenizer = []
    for name in TOKENIZER_FILES:
        path = contained(directory, name)
        if path.is_file():
            tokenizer.append((name, hashlib.sha256(path.read_bytes()).hexdigest()))
    return Adapter(
        directory=directory,
        config=config,
        config_sha256=hashlib.sha256(raw).hexdigest(),
        files=(InputFile(WEIGHTS_NAME, header.file_size, file_identity(weights, header.raw), seen),),
        targets=targets,
        replacements=replacements,
        tokenizer=tuple(tokenizer),
    )


def _read_tensors(
    header: Header, settings: LoraSettings, path: Path, yaml_path: str
) -> tuple[dict[str, LoraTarget], dict[str, TensorSource]]:
    factors: dict[tuple[str, str], dict[str, TensorSource]] = {}
    full: dict[str, tuple[FullTensor, TensorSource]] = {}
    for name in sorted(header.tensors):
        entry = header.tensors[name]
        source = TensorSource(WEIGHTS_NAME, entry)
        what = classify(name, path=path, yaml_path=yaml_path)
        if isinstance(what, Factor):
            factors.setdefault((what.module, what.kind), {})[what.factor] = source
        else:
            if what.base_name in full:
                raise _bad(path, yaml_path, name, f"replaces {what.base_name} a second time")
            full[what.base_name] = (what, source)
    targets: dict[str, LoraTarget] = {}
    for (module, kind), pair in sorted(factors.items()):
        base_name = f"{module}.weight"
        if base_name in targets:
            raise _bad(path, yaml_path, base_name, "has both linear and embedding LoRA factors")
        targets[base_name] = _target(module, kind, pair, settings, path, yaml_path)
    replacements: dict[str, TensorSource] = {}
    for base_name, (what, source) in sorted(full.items()):
        if what.adapted_module is not None and f"{what.adapted_module}.weight" not in targets:
            raise _bad(path, yaml_path, source.entry.name, f"is a base_layer tensor of {what.adapted_module}, "
                       "which has no LoRA factors")
        if what.adapted_module is None and f"{base_name.rpartition('.')[0]}.weight" in targets:
            # PEFT names such a tensor <module>.base_layer.<param>; under this name it would silently drop it.
            raise _bad(path, yaml_path, source.entry.name, "belongs to a LoRA-adapted module but lacks .base_layer")
        replacements[base_name] = source
    return targets, replacements


def _target(
    module: str, kind: str, pair: Mapping[str, TensorSource], settings: LoraSettings, path: Path, yaml_path: str
) -> LoraTarget:
    names = ("lora_embedding_A", "lora_embedding_B") if kind == "embedding" else ("lora_A", "lora_B")
    for factor, label in zip(("A", "B"), names):
        if factor not in pair:
            raise _bad(path, yaml_path, f"{module}.{label}", "is missing, though its partner factor is present")
        entry = pair[factor].entry
        if entry.dtype not in _FLOAT_DTYPES or len(entry.shape) != 2:
            raise _bad(path, yaml_path, entry.name, f"is {entry.dtype} {list(entry.shape)}; LoRA factors must be "
                       "2-D float tensors (convolution and quantised adapters are not supported)")
    a, b = pair["A"], pair["B"]
    rank, alpha = settings.rank_and_alpha(module)
    if a.entry.shape[0] != rank or b.entry.shape[1] != rank:
        raise _bad(
            path, yaml_path, a.entry.name,
            f"has shape {list(a.entry.shape)} and its partner {list(b.entry.shape)}, but the config gives "
            f"{module} rank {rank}: A must be (rank, in) and B (out, rank)",
        )
    return LoraTarget(
        module=module, a=a, b=b, rank=rank, alpha=alpha, scale=settings.scale(rank, alpha),
        fan_in_fan_out=kind == "embedding" or settings.fan_in_fan_out, embedding=kind == "embedding",
    )


def _bad(path: Path, yaml_path: str, tensor: str, what: str) -> ModelInputError:
    return ModelInputError(f"{path}: tensor {tensor} {what}", yaml_path=yaml_path, path=str(path), tensor=tensor)
