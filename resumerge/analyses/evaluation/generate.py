"""Generation for lm-eval's ``generate_until`` tasks, where the whole model fits the memory budget: every
decoder layer and the head held for the whole generation (read once), each request's tokens generated one at a
time until one of its stop sequences (or the end-of-text token) appears or ``max_gen_toks`` are made, as lm-eval's
``hf`` model generates (its own ``normalize_gen_kwargs`` and ``handle_stop_sequences``): greedily, or sampled from
the evaluation's seed (:mod:`.genrequests`: each draw from a generator of its own, the same draws as the
layer-streamed generation's).

The model runs as transformers' own modules (:func:`cached_stream` builds them where the pass runs native ones), every
weight loaded, with transformers' KV cache: the context runs once, then each new token alone against the keys and
values kept of every position before it, as lm-eval's ``hf`` model generates (``model.generate`` with its cache), so
a step costs one position rather than the whole sequence. Not journaled: a killed generation runs again to the same
answers (each draw is the seed's, the request's and the step's alone).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from resumerge.analyses.evaluation.genrequests import Wanted
from resumerge.forward.engine.built import build_modules
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.machine.torch_import import torch


def resident_bytes(stream: ModelStream) -> int:
    """The model's every weight in float32: what holding it whole for generation takes."""
    return int(sum(p.numel() for p in stream.model.parameters())) * 4


def cached_stream(weights: Weights, config: Mapping[str, Any], dtype: torch.dtype, device: str = "cpu"
                  ) -> ModelStream:
    """The model read from ``weights`` as transformers' own modules (their forward takes a KV cache; the native
    ones compute the same numbers without one), each module run on ``device`` (the evaluation's ``--device``:
    its passes' device, so a generation runs where they do)."""
    built = build_modules(weights.directory, dtype, what="resumerge eval", native=False)
    return ModelStream(weights, config, dtype, what="resumerge eval", key="TARGET", built=built, device=device)


@contextmanager
def resident(stream: ModelStream) -> Iterator[Callable[[Wanted, int | None], Iterator[int]]]:
    """For the block, every weight of ``stream``'s model loaded (its embeddings, decoder layers, final norm and
    head, each read once) and a function from a request and the seed to the tokens after its context (greedy or
    drawn: :meth:`~.genrequests.Wanted.choose`), one at a time, each step running only the newest token against the
    KV cache of those before."""
    # the parts before the layers by the stream's own rule (OPT's embeddings inside its ``decoder`` beside the
    # layers), the layers (each once: a looped forward calls some several times), then the final norm and what runs
    # around the head (BERT's prediction transform; Dory's norm, run before its loops too, once)
    parts = list(dict.fromkeys([*stream._before_layers(), *stream.stack, *stream._around_head()]))
    head = stream.model.get_output_embeddings()
    loaded: list[torch.nn.Module] = []
    try:
        for part in parts:
            loaded.append(stream.load(part))
        loaded.append(stream.load(head, tied_head=stream.tied_head()))
        # the buffers of modules holding no weight (the rotary embeddings' frequencies) on the device too: the
        # forward runs there whole
        stream._on_device(stream.model)

        # the cache's name in this transformers' forward and output (``cache`` since 5.x, ``past_key_values`` before)
        name = "cache" if "cache" in inspect.signature(stream.model.forward).parameters else "past_key_values"

        def tokens(want: Wanted, seed: int | None) -> Iterator[int]:
            out = stream.model(input_ids=torch.tensor([list(want.tokens)], device=stream.device), use_cache=True)
            made: list[int] = []
            while True:
                token = want.choose(out.logits[0, -1], seed, made)
                yield token
                made.append(token)
                out = stream.model(input_ids=torch.tensor([[token]], device=stream.device), use_cache=True,
                                   **{name: getattr(out, name)})

        yield tokens
    finally:
        for part in loaded:
            stream.unload(part)


def generate(stream: ModelStream, lm: Any, asked: list[Wanted], seed: int | None) -> list[str]:
    """Each request's continuation (:func:`~.genrequests.wanted_all`; sampled ones drawn from ``seed``), cut at
    its first stop sequence (read, stopped and cut as the layer-streamed generation does)."""
    answers = []
    with torch.no_grad(), resident(stream) as continued:
        for want in asked:
            made: list[int] = []
            for token in continued(want, seed):
                made.append(token)
                if want.done(lm.tokenizer, made):
                    break
            answers.append(want.answer(lm.tokenizer, made))
    return answers
