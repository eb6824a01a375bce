"""What a ``generate_until`` request asks, read as lm-eval's ``hf`` model reads it (its own
``normalize_gen_kwargs`` and ``handle_stop_sequences``): the context's tokens cut on the left to leave room for
``max_gen_toks``, the stop sequences (``until``, the end-of-text token's text among them), and whether it samples;
when a continuation is done (a stop sequence in its text, the end-of-text token, ``max_gen_toks`` made) and the
answer it gives (its text cut at the first stop sequence). One home for both generations: the whole model held
(:mod:`.generate`) and one layer at a time (:mod:`.streamgen`).

Sampling follows lm-eval's ``hf`` model: ``do_sample`` true, or a temperature above 0 with ``do_sample`` not given,
samples (``do_sample`` false is greedy whatever the temperature; ``do_sample`` true with temperature 0 is refused, as
transformers refuses it). A sampled token is drawn from the temperature's softmax over the ``top_k`` most likely
tokens whose mass reaches ``top_p``, as transformers' ``generate`` draws it (``top_k``/``top_p`` not given: the
model's ``generation_config.json``, else transformers' 50 and 1). Each draw comes from a generator of its own, seeded
by the evaluation's torch seed, the request (its tokens and which of identical requests it is: lm-eval's ``repeats``
draw apart) and the token step: a draw depends on nothing else, so every run, a resume mid-generation, any order or
batching of the requests, the whole model held or one layer at a time, give the same answers. transformers draws
from one global generator in its batch's order, which cannot be reproduced request by request: sampled answers
match lm-eval's in distribution, not draw for draw. Any other generation kwarg (``num_beams``, ``min_p``, ...) is
refused in one line naming it, never ignored. The model's ``generation_config.json`` acts on each step's logits
before the argmax or the draw, as transformers' ``generate`` applies it (:mod:`.genconfig`: ``Wanted.processors``).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from resumerge.analyses.evaluation.genconfig import NONE, Processors, over
from resumerge.errors import UsageError
from resumerge.machine.torch_import import torch

DEFAULT_MAX_GEN_TOKS = 256
TOP_K = 50  # transformers' GenerationConfig default
# what lm-eval's normalize_gen_kwargs leaves that resumerge honours; another key is refused unless it is set as
# transformers' default leaves it (a no-op there, so here too)
# the generation_config settings a request's kwargs may give too, over the file's (as generate(**kwargs) takes them)
PROCESSED = frozenset({"repetition_penalty", "no_repeat_ngram_size", "min_length", "min_new_tokens",
                       "suppress_tokens", "begin_suppress_tokens"})
HONOURED = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}) | PROCESSED
_NO_OPS: Mapping[str, Any] = MappingProxyType({
    "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "typical_p": 1.0, "min_p": None,
    "no_repeat_ngram_size": 0, "use_cache": True,
})


@dataclass(frozen=True)
class Sampling:
    """How a sampled request draws: the softmax ``temperature``, the ``top_k`` most likely tokens (0: all), the
    smallest set of them whose mass reaches ``top_p``."""

    temperature: float
    top_k: int = TOP_K
    top_p: float = 1.0

    def draw(self, logits: torch.Tensor, seed: int) -> int:
        """A token drawn from ``logits`` (one position's, float32, on any device) by a CPU generator seeded with
        ``seed``: the same draw wherever the layers ran."""
        scores = logits.detach().to("cpu", torch.float64) / self.temperature
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
    new tokens, ``sampling`` (None: greedy), the ``eot`` token that ends it, and ``nth``: how many identical
    requests come before it (lm-eval's ``repeats``: each draws its own); ``processors``: what the model's
    ``generation_config.json`` does to each step's logits, and its end tokens (:mod:`.genconfig`)."""

    tokens: tuple[int, ...]
    until: tuple[str, ...]
    most: int
    sampling: Sampling | None
    eot: int
    nth: int = 0
    processors: Processors = NONE

    def choose(self, logits: torch.Tensor, seed: int | None, made: Sequence[int]) -> int:
        """The token after the context and the tokens ``made``, from the last position's ``logits`` (after the
        model's processors, as transformers' ``generate`` applies them): the largest (greedy, as transformers'
        argmax: the first of equals), or drawn (:meth:`Sampling.draw`) from a generator seeded by ``seed``, these
        tokens, ``nth`` and the step (:func:`wanted_all` refuses a sampled request without a seed)."""
        logits = self.processors(logits, self.tokens, made)
        step = len(made)
        if self.sampling is None:
            return int(logits.argmax())
        key = hashlib.sha256(f"{seed}:{self.nth}:{step}:{','.join(map(str, self.tokens))}".encode()).digest()
        return self.sampling.draw(logits, int.from_bytes(key[:8], "little") & ((1 << 63) - 1))

    def done(self, tokenizer: Any, made: Sequence[int]) -> bool:
        """Whether the continuation ``made`` is finished: ``most`` tokens, the end-of-text token, or a stop
        sequence in its text."""
        if not made:
            return False
        if len(made) >= self.most or made[-1] == self.eot or made[-1] in self.processors.eos:
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


def samples(gen_kwargs: Mapping[str, Any]) -> bool:
    """Whether lm-eval's generation kwargs ``gen_kwargs`` sample (lm-eval's ``normalize_gen_kwargs`` reading)."""
    from lm_eval.models.utils import normalize_gen_kwargs

    return bool(normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS).get("do_sample"))


def honoured(gen_kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``gen_kwargs`` as lm-eval's ``normalize_gen_kwargs`` gives them, or :class:`UsageError` (exit 2) naming
    the first one resumerge does not honour (``where``: where they were given, for the message)."""
    from lm_eval.models.utils import normalize_gen_kwargs

    kwargs: dict[str, Any] = dict(normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS))
    for key, value in kwargs.items():
        if key not in HONOURED and not (key in _NO_OPS and value == _NO_OPS[key]):
            raise UsageError(f"{where} {key}={value}: resumerge does not honour it",
                             hint="leave it out: resumerge generates with until, max_gen_toks, do_sample, "
                                  "temperature, top_k, top_p, " + ", ".join(sorted(PROCESSED)))
    if kwargs.get("do_sample") and not float(kwargs.get("temperature") or 0.0) > 0:
        raise UsageError(f"{where} do_sample=True with temperature 0 (transformers refuses it)",
                         hint="give a temperature above 0 to sample, or do_sample=False for greedy")
    return kwargs


def wanted_all(lm: Any, requests: Sequence[tuple[str, Mapping[str, Any]]], seed: int | None,
               defaults: Mapping[str, Any] | None = None, processors: Processors = NONE) -> list[Wanted]:
    """Each of ``requests`` (context, lm-eval's generation kwargs) as :func:`wanted` reads it, numbered among those
    identical to it (:attr:`Wanted.nth`); ``seed``: the evaluation's torch seed, which a sampled request needs
    (None refused, exit 2); ``defaults``: the model's own ``top_k``/``top_p`` (its ``generation_config.json``);
    ``processors``: the rest of that file that every request honours (:func:`~.genconfig.processors_of`)."""
    seen: Counter[str] = Counter()
    asked = []
    for context, kwargs in requests:
        shown = json.dumps([context, kwargs], sort_keys=True, default=str)
        asked.append(wanted(lm, context, kwargs, defaults=defaults, nth=seen[shown], processors=processors))
        seen[shown] += 1
    if seed is None and any(w.sampling is not None for w in asked):
        raise UsageError("--seed leaves torch's seed unset (None), and a generation samples from it",
                         hint="give the third figure of --seed a number")
    return asked


def wanted(lm: Any, context: str, gen_kwargs: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None,
           nth: int = 0, processors: Processors = NONE) -> Wanted:
    """The request (``context``, lm-eval's generation kwargs) for the lm-eval model ``lm`` (its tokenizer, context
    length and ``tok_encode``), the ``nth`` of those identical to it; ``defaults``: the ``top_k``/``top_p`` of the
    model's ``generation_config.json`` (transformers' own where it sets none). Refuses (exit 2) a kwarg not
    honoured (:func:`honoured`) and one that asks for more new tokens than the model's context holds.
    ``processors``: the model file's (:func:`~.genconfig.processors_of`), each setting the kwargs give too taken from
    the kwargs instead, as ``generate(**kwargs)`` takes it over the file's."""
    from lm_eval.models.utils import handle_stop_sequences

    kwargs = honoured(gen_kwargs, "a generation task's generation_kwargs")
    eos = lm.tokenizer.decode(lm.eot_token_id, skip_special_tokens=False)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    most = int(kwargs.pop("max_gen_toks"))
    room = lm.max_length - most
    if room <= 0:
        raise UsageError(f"a generation task asks for {most} new tokens, the model's context is {lm.max_length}",
                         hint="lower max_gen_toks in the task's generation_kwargs")
    tokens = tuple(lm.tok_encode(context, left_truncate_len=room))
    drawn = None
    if kwargs.get("do_sample"):
        own = {**(defaults or {}), **{k: kwargs[k] for k in ("top_k", "top_p") if kwargs.get(k) is not None}}
        drawn = Sampling(float(kwargs["temperature"]), int(own.get("top_k", TOP_K) or 0),
                         float(own.get("top_p", 1.0)))
    given = {k: kwargs[k] for k in PROCESSED if kwargs.get(k) is not None}
    return replace(Wanted(tokens, tuple(until), most, drawn, int(lm.eot_token_id), nth),
                   processors=over(processors, given, "a generation task's generation_kwargs"))


def model_defaults(directory: Any) -> dict[str, Any]:
    """The ``top_k`` and ``top_p`` the model's ``generation_config.json`` in ``directory`` sets (transformers'
    ``generate`` takes them where the request gives none); none where it has no such file."""
    from pathlib import Path

    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    found = json.loads(path.read_text(encoding="utf-8"))
    return {k: found[k] for k in ("top_k", "top_p") if found.get(k) is not None}
