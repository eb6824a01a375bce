"""Greedy generation for lm-eval's ``generate_until`` tasks, where the whole model fits the memory budget: every
decoder layer and the head held for the whole generation (read once), each request's tokens generated one at a
time until one of its stop sequences (or the end-of-text token) appears or ``max_gen_toks`` are made, as lm-eval's
``hf`` model generates greedily (its own ``normalize_gen_kwargs`` and ``handle_stop_sequences``).

Each step runs the model over the whole sequence so far (no KV cache: a step costs the sequence's length, fine for the
short answers such tasks score); the embeddings are read at each step (:meth:`ModelStream.inputs`). Sampling
(``do_sample``, a temperature above 0) is refused: greedy generation is what a deterministic, resumable evaluation
can promise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from resumerge.errors import UsageError
from resumerge.forward.stream import ModelStream
from resumerge.torch_import import torch

DEFAULT_MAX_GEN_TOKS = 256


def resident_bytes(stream: ModelStream) -> int:
    """The model's every weight in float32: what holding it whole for generation takes."""
    return int(sum(p.numel() for p in stream.model.parameters())) * 4


@contextmanager
def resident(stream: ModelStream) -> Iterator[Any]:
    """A function from a token list to the logits at its last position, every decoder layer and the head held
    for the block."""
    with ExitStack() as stack:
        layers = [stack.enter_context(stream.loaded(layer)) for layer in stream.layers_list]
        head = stack.enter_context(stream.head())

        def last_logits(tokens: list[int]) -> torch.Tensor:
            ids = torch.tensor([tokens])
            ((hidden, calls),) = stream.inputs([(ids, torch.ones_like(ids))])
            for index, layer in enumerate(layers):
                hidden = stream.run(layer, hidden, calls[index])
            logits: torch.Tensor = head(hidden[:, -1:])[0, -1]
            return logits

        yield last_logits


def generate(stream: ModelStream, lm: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each request's greedy continuation (context, lm-eval's generation kwargs), cut at its first stop sequence."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    eos = lm.tokenizer.decode(lm.eot_token_id, skip_special_tokens=False)
    answers = []
    with torch.no_grad(), resident(stream) as last_logits:
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
            while len(made) < most:
                made.append(int(last_logits(tokens + made).argmax()))
                text = lm.tokenizer.decode(made, skip_special_tokens=True)
                if made[-1] == lm.eot_token_id or any(stop and stop in text for stop in until):
                    break
            text = lm.tokenizer.decode(made, skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            answers.append(text)
    return answers
