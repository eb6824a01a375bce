"""What a ``generate_until`` request asks, read as lm-eval's ``hf`` model reads it (its own
``normalize_gen_kwargs`` and ``handle_stop_sequences``): the context's tokens cut on the left to leave room for
``max_gen_toks``, the stop sequences (``until``, the end-of-text token's text among them), and whether it samples;
when a continuation is done (a stop sequence in its text, the end-of-text token, ``max_gen_toks`` made) and the
answer it gives (its text cut at the first stop sequence). One home for both generations: the whole model held
(:mod:`.generate`) and one layer at a time (:mod:`.streamgen`).

Sampling (``do_sample``, or a temperature above 0) draws each token from the temperature's softmax over the
``top_k`` most likely tokens (50 unless asked, as transformers' default) whose mass reaches ``top_p`` (1 unless
asked), from a generator seeded by the evaluation's seed, the request's tokens and the token step: the same draws on
every run, and on a resume, in any order of the requests. transformers' own draws from one global generator cannot
be reproduced request by request, so sampled answers match lm-eval's in distribution, not draw for draw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from resumerge.errors import UsageError
from resumerge.torch_import import torch

DEFAULT_MAX_GEN_TOKS = 256
TOP_K = 50  # transformers' GenerationConfig default


@dataclass(frozen=True)
class Sampling:
    """How a sampled request draws: the softmax ``temperature``, the ``top_k`` most likely tokens (0: all), the
    smallest set of them whose mass reaches ``top_p``."""

    temperature: float
    top_k: int = TOP_K
    top_p: float = 1.0

    def draw(self, logits: torch.Tensor, seed: int) -> int:
        """A token drawn from ``logits`` (one position's, float32) by a generator seeded with ``seed``."""
        scores = logits.double() / max(self.temperature, 1e-5)
        if 0 < self.top_k < scores.numel():
            kept = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kept, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            mass = torch.softmax(ordered, dim=-1).cumsum(-1)
            cut = mass - torch.softmax(ordered, dim=-1) >= self.top_p  # the tokens past the mass asked
            scores = scores.masked_fill(torch.zeros_like(cut).scatter(0, order, cut), float("-inf"))
        generator = torch.Generator().manual_seed(seed)
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


@dataclass(frozen=True)
class Wanted:
    """One request as generation runs it: the context's ``tokens``, the stop sequences ``until``, at most ``most``
    new tokens, ``sampling`` (None: greedy), and the ``eot`` token that ends it."""

    tokens: tuple[int, ...]
    until: tuple[str, ...]
    most: int
    sampling: Sampling | None
    eot: int

    def choose(self, logits: torch.Tensor, seed: int, step: int) -> int:
        """The token after the context and ``step`` tokens made, from the last position's ``logits``: the largest
        (greedy, as transformers' argmax: the first of equals), or drawn (:meth:`Sampling.draw`) from a generator
        seeded by ``seed``, these tokens and ``step``."""
        if self.sampling is None:
            return int(logits.argmax())
        key = hashlib.sha256(f"{seed}:{step}:{','.join(map(str, self.tokens))}".encode()).digest()
        return self.sampling.draw(logits, int.from_bytes(key[:8], "little") & ((1 << 63) - 1))

    def done(self, tokenizer: Any, made: Sequence[int]) -> bool:
        """Whether the continuation ``made`` is finished: ``most`` tokens, the end-of-text token, or a stop
        sequence in its text."""
        if not made:
            return False
        if len(made) >= self.most or made[-1] == self.eot:
            return True
        text = tokenizer.decode(list(made), skip_special_tokens=True)
        return any(stop and stop in text for stop in self.until)

    def answer(self, tokenizer: Any, made: Sequence[int]) -> str:
        """The continuation's text, cut at each stop sequence in turn (as the ``hf`` model cuts it)."""
        text: str = tokenizer.decode(list(made), skip_special_tokens=True)
        for stop in self.until:
            if stop:
                text = text.split(stop)[0]
        return text


def wanted(lm: Any, context: str, gen_kwargs: dict[str, Any], *, sampling: bool = True) -> Wanted:
    """The request (``context``, lm-eval's generation kwargs) for the lm-eval model ``lm`` (its tokenizer, context
    length and ``tok_encode``); ``sampling`` False: one that samples is refused (exit 2). Refuses (exit 2) one that
    asks for more new tokens than the model's context holds."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
    temperature = float(kwargs.get("temperature") or 0.0)
    samples = bool(kwargs.get("do_sample")) or temperature > 0
    if samples and not sampling:
        raise UsageError("a generation task asks for sampling; eval generates greedily only",
                         hint="set do_sample: false in the task's generation_kwargs")
    eos = lm.tokenizer.decode(lm.eot_token_id, skip_special_tokens=False)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    most = int(kwargs.pop("max_gen_toks"))
    room = lm.max_length - most
    if room <= 0:
        raise UsageError(f"a generation task asks for {most} new tokens, the model's context is {lm.max_length}",
                         hint="lower max_gen_toks in the task's generation_kwargs")
    tokens = tuple(lm.tok_encode(context, left_truncate_len=room))
    drawn = None
    if samples:
        drawn = Sampling(temperature if temperature > 0 else 1.0, int(kwargs.get("top_k") or TOP_K),
                         float(kwargs.get("top_p") or 1.0))
    return Wanted(tokens, tuple(until), most, drawn, int(lm.eot_token_id))
