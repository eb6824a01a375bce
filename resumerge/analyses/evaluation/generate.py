"""Greedy generation for lm-eval's ``generate_until`` tasks, where the whole model fits the memory budget: every
decoder layer and the head held for the whole generation (read once), each request's tokens generated one at a
time until one of its stop sequences (or the end-of-text token) appears or ``max_gen_toks`` are made, as lm-eval's
``hf`` model generates greedily (its own ``normalize_gen_kwargs`` and ``handle_stop_sequences``).

The model runs as transformers' own modules (:func:`cached_stream` builds them where the pass runs native ones), every
weight loaded, with transformers' KV cache: the context runs once, then each new token alone against the keys and
values kept of every position before it, as lm-eval's ``hf`` model generates (``model.generate`` with its cache), so
a step costs one position rather than the whole sequence. Sampling (``do_sample``, a temperature above 0) is
refused: greedy generation is what a deterministic, resumable evaluation can promise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from resumerge.analyses.evaluation.genrequests import wanted
from resumerge.forward import Weights
from resumerge.forward.stream import ModelStream, build_modules
from resumerge.torch_import import torch


def resident_bytes(stream: ModelStream) -> int:
    """The model's every weight in float32: what holding it whole for generation takes."""
    return int(sum(p.numel() for p in stream.model.parameters())) * 4


def cached_stream(weights: Weights, config: Mapping[str, Any], dtype: torch.dtype) -> ModelStream:
    """The model read from ``weights`` as transformers' own modules (their forward takes a KV cache; the native
    ones compute the same numbers without one)."""
    built = build_modules(weights.directory, dtype, what="resumerge eval", native=False)
    return ModelStream(weights, config, dtype, what="resumerge eval", key="TARGET", built=built)


@contextmanager
def resident(stream: ModelStream) -> Iterator[Callable[[list[int]], Iterator[int]]]:
    """For the block, every weight of ``stream``'s model loaded (its embeddings, decoder layers, final norm and
    head, each read once) and a function from a token list to the greedy tokens after it, one at a time, each step
    running only the newest token against the KV cache of those before."""
    parts = [c for c in stream.inner.children() if c is not stream.layers_list and any(True for _ in c.parameters())]
    parts += list(stream.layers_list)
    head = stream.model.get_output_embeddings()
    loaded: list[torch.nn.Module] = []
    try:
        for part in parts:
            loaded.append(stream.load(part))
        loaded.append(stream.load(head, tied_head=stream.tied_head()))

        # the cache's name in this transformers' forward and output (``cache`` since 5.x, ``past_key_values`` before)
        name = "cache" if "cache" in inspect.signature(stream.model.forward).parameters else "past_key_values"

        def greedy(tokens: list[int]) -> Iterator[int]:
            out = stream.model(input_ids=torch.tensor([tokens]), use_cache=True)
            while True:
                token = int(out.logits[0, -1].argmax())
                yield token
                out = stream.model(input_ids=torch.tensor([[token]]), use_cache=True, **{name: getattr(out, name)})

        yield greedy
    finally:
        for part in loaded:
            stream.unload(part)


def generate(stream: ModelStream, lm: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each request's greedy continuation (context, lm-eval's generation kwargs), cut at its first stop sequence
    (:mod:`.genrequests`: read, stopped and cut as the layer-streamed generation does)."""
    asked = [wanted(lm, context, gen_kwargs, sampling=False) for context, gen_kwargs in requests]
    answers = []
    with torch.no_grad(), resident(stream) as greedy:
        for want in asked:
            made: list[int] = []
            for token in greedy(list(want.tokens)):
                made.append(token)
                if want.done(lm.tokenizer, made):
                    break
            answers.append(want.answer(lm.tokenizer, made))
    return answers
