"""``check``'s NLL of one model and transformers' unpadded whole-model NLL of it, for the family tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resumerge.analyses.check.models import Checked
from resumerge.config.modelref import ModelRef
from resumerge.forward.compared.passes import forward_pass, streams_of
from resumerge.inputs.model import open_model
from resumerge.machine.torch_import import torch


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


def unpadded_nll(directory: Path, tokens: list[list[int]], reference: Any = None) -> float:
    """transformers' NLL per predicted token, each sequence alone (no padding): each next token's log-probability
    under the causal-LM class's own logits. (Not its ``loss``: TrOCR's takes its labels as already shifted, a
    decoder's targets, so ``labels=ids`` scores each token at its own position.) ``reference``: transformers' model
    of ``directory`` in float32 where the caller loaded it already (the census's read-back), else loaded here."""
    from transformers import AutoModelForCausalLM

    if reference is None:
        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    total = 0.0
    with torch.no_grad():  # every hidden state asked for: Gemma 4's key-sharing shortcut fails otherwise (5.24)
        for ids in tokens:
            logits = reference(input_ids=torch.tensor([ids]), output_hidden_states=True).logits[0, :-1].float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1))
            total -= float(picked.sum())
    return total / sum(len(ids) - 1 for ids in tokens)
