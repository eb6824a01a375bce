"""``resumerge measure … --imatrix OUT.gguf`` (or ``OUT.dat``): the measurement's Grams as llama.cpp's importance
matrix. The diagonal of a linear's input Gram (the mean of x·xᵀ) times the tokens is what llama-imatrix accumulates
for that weight (the sum of each input column's squares); each weight named as llama.cpp names it in the GGUF
(:mod:`resumerge.analyses.importance.entries`); a mixture of experts' routed stacks have no Grams, and their layer
files hold each expert's sums and count instead (:mod:`.grams`). Several models' sums are pooled: each weight's sums
and counts added, the matrix of their inputs together (one model's is llama-imatrix's own of that model)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from resumerge.forward.sums.imatrix import imatrix_file, named_entries, pooled, write_imatrix
from resumerge.inputs.grams import Measurement
from resumerge.outputs.gguf.imatrix import ImatrixEntry


def measured_entries(folder: Path, measurement: Measurement, archs: Sequence[str]) -> dict[str, ImatrixEntry]:
    """Every measured model's entries (model i's weights named as an ``archs[i]`` GGUF names them), pooled."""
    from safetensors import safe_open

    from resumerge.analyses.measure.grams import EXPERT_COUNTS, EXPERT_SUMS

    each = []
    for model, arch in zip(measurement.models, archs):
        sums: dict[str, np.ndarray] = {}
        for linear, ref in sorted(model.grams.items()):
            with safe_open(os.fspath(folder / ref.file), framework="pt") as file:
                gram = file.get_tensor(ref.tensor)
            sums[linear] = (gram.diagonal().double().numpy() * model.tokens).astype(np.float32)
        # a mixture of experts' routed stacks: their per-expert sums and counts, as the layer files hold them
        counts: dict[str, np.ndarray] = {}
        for name in sorted(model.sha256):
            with safe_open(os.fspath(folder / name), framework="pt") as file:
                stored = file.keys()  # (safe_open is not iterable)
                for key in stored:
                    if key.startswith(EXPERT_SUMS):
                        sums[key.removeprefix(EXPERT_SUMS)] = file.get_tensor(key).numpy()
                    elif key.startswith(EXPERT_COUNTS):
                        counts[key.removeprefix(EXPERT_COUNTS)] = file.get_tensor(key).numpy()
        each.append(named_entries(arch, sums, model.tokens, counts or None))
    return pooled(each)


def write_measured(folder: Path, measurement: Measurement, archs: Sequence[str], out: Path, dataset: str) -> int:
    """The importance matrix of the measurement in ``folder`` written to ``out`` (llama-imatrix's GGUF; its older
    ``.dat`` form where ``out`` ends in ``.dat``, as llama-imatrix's ``--output-format dat``); its entry count."""
    entries = measured_entries(folder, measurement, archs)
    dat = out.suffix.lower() == ".dat"
    write_imatrix(out, imatrix_file(entries, dataset, measurement.sequences, dat=dat))
    return len(entries)
