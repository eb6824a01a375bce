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

from resumerge.errors import UsageError
from resumerge.forward import Weights
from resumerge.forward.stream import ModelStream, build_modules
from resumerge.torch_import import torch

DEFAULT_MAX_GEN_TOKS = 256


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
    """Each request's greedy continuation (context, lm-eval's generation kwargs), cut at its first stop sequence."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    eos = lm.tokenizer.decode(lm.eot_token_id, skip_special_tokens=False)
    answers = []
    with torch.no_grad(), resident(stream) as greedy:
        for context, gen_kwargs in requests:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise UsageError("a generation task asks for sampling; eval generates greedily only",
                                 hint="set do_sample: false in the task's generation_kwargs")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            most = int(kwargs.pop("max_gen_toks"))
            room = lm.max_length - most
            if room <= 0:
                raise UsageError(f"a generation task asks for {most} new tokens, the model's context is "
                                 f"{lm.max_length}", hint="lower max_gen_toks in the task's generation_kwargs")
            tokens = lm.tok_encode(context, left_truncate_len=room)
            made: list[int] = []
            for token in greedy(tokens):
                made.append(token)
                text = lm.tokenizer.decode(made, skip_special_tokens=True)
                if len(made) >= most or token == lm.eot_token_id or any(stop and stop in text for stop in until):
                    break
            text = lm.tokenizer.decode(made, skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            answers.append(text)
    return answers
