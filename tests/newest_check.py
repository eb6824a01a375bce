"""``check``'s NLL of one model and transformers' unpadded whole-model NLL of it, for the family tests."""

from __future__ import annotations

from pathlib import Path

from resumerge.config.modelref import ModelRef
from resumerge.forward.models import Checked
from resumerge.forward.passes import forward_pass, streams_of
from resumerge.inputs.model import open_model
from resumerge.torch_import import torch


def checked_nll(directory: Path, tokens: list[list[int]], journal: Path) -> float:
    """The NLL per predicted token ``check``'s pass gives the model in ``directory`` over ``tokens``."""
    model = Checked("merge", str(directory), None, open_model(ModelRef(str(directory)), directory=directory))
    streams = streams_of([model])
    try:
        figures = forward_pass([model], streams, tokens, journal)
    finally:
        for stream in streams:
            stream.close()
    return float(figures.nll[0])


def unpadded_nll(directory: Path, tokens: list[list[int]]) -> float:
    """transformers' NLL per predicted token, each sequence alone (no padding)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():  # every hidden state asked for: Gemma 4's key-sharing shortcut fails otherwise (5.24)
        losses = [float(reference(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]),
                                  output_hidden_states=True).loss) * (len(ids) - 1) for ids in tokens]
    return sum(losses) / sum(len(ids) - 1 for ids in tokens)
