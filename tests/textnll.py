"""Texts' negative log-likelihoods through the forward engine's :class:`ModelStream`, one decoder layer at a time: a
model's (:func:`stream_nlls`), or each candidate's of a generation read together (:func:`population_nlls`, every
candidate's layer run inside that layer's block). What the unwritten-merge tests compare a written merge with, and
what ``bench/bench_unwritten.py`` measures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.merge.engine.unwritten import Population


def _head_nlls(stream: ModelStream, hidden: Sequence[torch.Tensor], ids: Sequence[torch.Tensor]) -> list[float]:
    """Each text's summed NLL of its next tokens, from the last layer's hidden states through the head."""
    with stream.head() as logits:
        figures = []
        for h, i in zip(hidden, ids, strict=True):
            logp = torch.log_softmax(logits(h).double(), dim=-1)[0, :-1]
            figures.append(-float(logp.gather(1, i[0, 1:, None]).sum()))
    return figures


def stream_nlls(weights: Weights, config: Mapping[str, Any], texts: Sequence[Sequence[int]],
                what: str = "test") -> list[float]:
    """Each of ``texts``' (token ids) summed NLL over ``weights``, one decoder layer at a time."""
    ids = [torch.tensor([t]) for t in texts]
    with ModelStream(weights, dict(config), torch.float32, what=what) as stream, torch.no_grad():
        entering = stream.inputs([(i, torch.ones_like(i)) for i in ids])
        hidden = [h for h, _ in entering]
        for index, layer in enumerate(stream.layers_list):
            with stream.loaded(layer):
                hidden = [stream.run(layer, h, calls[index]) for h, (_, calls) in zip(hidden, entering, strict=True)]
        return _head_nlls(stream, hidden, ids)


def population_nlls(population: Population, texts: Sequence[Sequence[int]], what: str = "test") -> list[list[float]]:
    """Each candidate's NLLs of ``texts``, every layer of every candidate run inside that layer's block of the
    generation (the candidates after the first share its built model)."""
    ids = [torch.tensor([t]) for t in texts]
    streams: list[ModelStream] = []
    for c in population.candidates:
        built = (streams[0].config, streams[0].model) if streams else None
        streams.append(ModelStream(Weights.of(c.directory, c.tensors, source=c.source), c.config, torch.float32,
                                   what=what, built=built))
    with torch.no_grad():
        with population.layer():
            entering = [s.inputs([(i, torch.ones_like(i)) for i in ids]) for s in streams]
        hidden = [[h for h, _ in e] for e in entering]
        for index in range(streams[0].layers):
            with population.layer():
                for c, stream in enumerate(streams):
                    layer = stream.layers_list[index]
                    with stream.loaded(layer):
                        hidden[c] = [stream.run(layer, h, calls[index])
                                     for h, (_, calls) in zip(hidden[c], entering[c], strict=True)]
        with population.layer():
            return [_head_nlls(stream, hidden[c], ids) for c, stream in enumerate(streams)]
