"""``resumerge measure … --imatrix OUT.gguf``: the measurement's Grams as llama.cpp's importance matrix. The diagonal
of a linear's input Gram (the mean of x·xᵀ) times the tokens is what llama-imatrix accumulates for that weight (the
sum of each input column's squares); each weight named as llama.cpp names it in the GGUF (:mod:`resumerge.analyses.
importance.entries`). Several models' sums are pooled: each weight's sums and counts added, the matrix of their
inputs together (one model's is llama-imatrix's own of that model)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from resumerge.forward.imatrix import imatrix_file, named_entries, pooled, write_imatrix
from resumerge.inputs.grams import Measurement
from resumerge.outputs.gguf.imatrix import ImatrixEntry


def measured_entries(folder: Path, measurement: Measurement, archs: Sequence[str]) -> dict[str, ImatrixEntry]:
    """Every measured model's entries (model i's weights named as an ``archs[i]`` GGUF names them), pooled."""
    from safetensors import safe_open

    each = []
    for model, arch in zip(measurement.models, archs):
        sums: dict[str, np.ndarray] = {}
        for linear, ref in sorted(model.grams.items()):
            with safe_open(os.fspath(folder / ref.file), framework="pt") as file:
                gram = file.get_tensor(ref.tensor)
            sums[linear] = (gram.diagonal().double().numpy() * model.tokens).astype(np.float32)
        each.append(named_entries(arch, sums, model.tokens))
    return pooled(each)


def write_measured(folder: Path, measurement: Measurement, archs: Sequence[str], out: Path, dataset: str) -> int:
    """The importance matrix of the measurement in ``folder`` written to ``out`` (llama-imatrix's GGUF); its entry
    count."""
    entries = measured_entries(folder, measurement, archs)
    write_imatrix(out, imatrix_file(entries, dataset, measurement.sequences))
    return len(entries)
