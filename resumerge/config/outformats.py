"""The output formats ``--out-type`` names, one row each: the format's name, its container (the class that owns its
files: :class:`resumerge.outputs.containers.OutputContainer`, imported on first use by ``module:Class``) and the
plan options that only it reads.

Light on purpose: the CLI's parser reads the names (``--out-type``'s choices), and the CLI may not import
``outputs/`` (nor would ``status`` stay light if it did). The API asks :func:`takes` whether the format given takes
an option (a GGUF output's ``--gguf-type`` ...) instead of comparing names; the planner's container factory
(:func:`resumerge.outputs.containers.container_for`) imports the row's class and hands it the plan's options, of
which each container reads its own.

A new output format is its container class (in its package under ``outputs/``) and one row of :data:`OUT_FORMATS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["GGUF_OPTIONS", "OUT_FORMATS", "OutFormat", "out_format", "out_types", "takes"]


@dataclass(frozen=True)
class OutFormat:
    """One ``--out-type``: its name, its container (``module:Class``) and the plan options only it reads (names of
    :class:`~resumerge.merge.plan.merge_plan.PlanOptions`' fields)."""

    name: str
    container: str
    options: frozenset[str] = frozenset()


# A GGUF output's options: its types, split, importance matrix, key-values and size target.
GGUF_OPTIONS = frozenset({"gguf_type", "gguf_split_max_size", "gguf_tensor_types", "gguf_output_type",
                          "gguf_token_embedding_type", "imatrix", "imatrix_texts", "gguf_override_kv", "gguf_pure",
                          "gguf_target_size", "gguf_target_bpw"})

# --out-type -> its row (in the order --help lists them)
OUT_FORMATS: Mapping[str, OutFormat] = MappingProxyType({
    "safetensors": OutFormat("safetensors", "resumerge.outputs.containers:SafetensorsShards"),
    "gguf": OutFormat("gguf", "resumerge.outputs.containers:GgufFile", GGUF_OPTIONS),
})


def out_types() -> tuple[str, ...]:
    """The names ``--out-type`` takes, in the table's order."""
    return tuple(OUT_FORMATS)


def out_format(name: str | None) -> OutFormat | None:
    """The row of ``--out-type name`` (None: no such format)."""
    return OUT_FORMATS.get(name or "")


def takes(name: str | None, option: str) -> bool:
    """Whether the output format ``name`` reads plan option ``option`` (False for no such format)."""
    row = out_format(name)
    return row is not None and option in row.options
