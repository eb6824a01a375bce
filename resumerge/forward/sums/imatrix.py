"""Sums of squared inputs by Hugging Face linear, named and written as llama-imatrix writes them (``kquants.md`` §4):
each weight's entry under its GGUF name, the linears sharing an input (q/k/v, gate/up) each their own identical entry,
as llama-imatrix records them; the head is left out (llama-imatrix measures it only with ``--process-output``). A
mixture of experts' fused stack (``experts.gate_up_proj``: gate's and up's entries; ``experts.down_proj``) has one
row of sums and one count per expert, as llama-imatrix records a ``MUL_MAT_ID``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.names import ARCH_OF, expert_target, gguf_name
from resumerge.outputs.gguf.imatrix import ImatrixEntry, imatrix_bytes, imatrix_dat_bytes

# The GGUF names llama-imatrix never records (it measures the matmuls of the decoder blocks only).
_OUTSIDE = ("output.weight", "token_embd.weight")


def gguf_arch(model_type: object, option: str) -> str:
    """The GGUF architecture of a model of ``model_type`` (config.json's), whose importance matrix names its weights
    as llama.cpp names them; :class:`ModelInputError` (exit 2) naming ``option`` for a family resumerge does not
    write as GGUF."""
    arch = ARCH_OF.get(str(model_type))
    if arch is None:
        raise ModelInputError(f"{option}: a {model_type} model, whose GGUF names resumerge does not know (it writes "
                              f"{', '.join(sorted(set(ARCH_OF)))})", hint=f"leave out {option}")
    return arch


def named_entries(arch: str, sums: Mapping[str, np.ndarray], tokens: int,
                  counts: Mapping[str, np.ndarray] | None = None) -> dict[str, ImatrixEntry]:
    """The entries of the linears ``sums`` (by checkpoint module name: float sums of each input column's squares
    over ``tokens`` positions) under their GGUF weight names in an ``arch`` file; a fused experts stack's
    (``….experts.gate_up_proj``: [E, n_in], one row per expert) over the tokens routed to each expert, ``counts``
    of its experts module (``….experts``: [E])."""
    found: dict[str, ImatrixEntry] = {}
    for linear, values in sums.items():
        stack = expert_target(linear)
        if stack is not None and stack[1] is None:
            routed = (counts or {})[linear.rpartition(".")[0]]
            for name in stack[0]:  # gate's and up's entries are the same sums, as llama-imatrix's are
                found[name] = ImatrixEntry(np.asarray(values, dtype=np.float32).reshape(len(routed), -1),
                                           np.asarray(routed, dtype=np.float32))
            continue
        dense = gguf_name(arch, f"{linear}.weight", experts=counts is not None and bool(counts))
        if dense is None or dense in _OUTSIDE:
            continue
        found[dense] = ImatrixEntry(np.asarray(values, dtype=np.float32).reshape(1, -1),
                                   np.array([tokens], dtype=np.float32))
    return found


def pooled(entries: Sequence[Mapping[str, ImatrixEntry]]) -> dict[str, ImatrixEntry]:
    """Several models' entries as one: each weight's sums added and its counts added (as if each model had run the
    texts in turn); a weight one model lacks keeps the others'."""
    out: dict[str, ImatrixEntry] = {}
    for each in entries:
        for name, entry in each.items():
            had = out.get(name)
            out[name] = entry if had is None else ImatrixEntry(
                (had.sums.astype(np.float64) + entry.sums).astype(np.float32), had.counts + entry.counts)
    return out


def imatrix_file(entries: Mapping[str, ImatrixEntry], dataset: str, texts: int, *, dat: bool = False) -> bytes:
    """The GGUF of ``entries`` measured over ``texts`` texts of the file ``dataset``: ``imatrix.chunk_count`` the
    texts, ``imatrix.chunk_size`` the tokens a text had on average, rounded up (so the older ``.dat`` form's call
    count, ``ceil(count / chunk_size)``, is the texts); ``dat``: that older form instead, with the same chunks."""
    most = max((float(e.counts.max()) for e in entries.values()), default=0.0)
    size = max(1, math.ceil(most / max(texts, 1)))
    if dat:
        return imatrix_dat_bytes(entries, dataset, max(texts, 1), size)
    return imatrix_bytes(entries, [dataset], max(texts, 1), size)


def write_imatrix(path: Path, data: bytes) -> None:
    """``data`` written to ``path`` durably (temp, fsync, rename, fsync dir)."""
    from resumerge.machine.durable import write_file_atomic

    write_file_atomic(path, data)
