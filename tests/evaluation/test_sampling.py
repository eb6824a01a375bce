"""Sampled generation's pieces (:mod:`resumerge.analyses.evaluation.genrequests`, the seeds of
:mod:`resumerge.analyses.evaluation.settings`): ``--seed`` read as lm-eval's parser reads it (the oracle), generation
kwargs read as lm-eval's ``hf`` model reads them (what samples, what is refused), and each draw a function of the
seed, the request and the step alone. In this process, no model: well under a second past lm-eval's import."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lm_eval")

from resumerge.analyses.evaluation.genrequests import Sampling, Wanted, honoured, samples
from resumerge.analyses.evaluation.settings import Seeds
from resumerge.errors import UsageError
from resumerge.machine.torch_import import torch


@pytest.mark.parametrize("given", ["42", "0,1234,1234,1234", "1,2,3", "0,None,8,52", "none", " 5 , 6 ,7,8"])
def test_seed_is_read_as_lm_evals_parser_reads_it(given: str) -> None:
    from lm_eval._cli.utils import _int_or_none_list_arg_type

    theirs = _int_or_none_list_arg_type(3, 4, "0,1234,1234,1234", given)
    seeds = Seeds.parse(given)
    assert [seeds.random, seeds.numpy, seeds.torch, seeds.fewshot] == theirs
    assert Seeds.parse(seeds.words()) == seeds


@pytest.mark.parametrize("given", ["1,2", "a", "1,2,3,4,5", ""])
def test_a_seed_lm_eval_refuses_is_one_line(given: str) -> None:
    with pytest.raises(UsageError, match="is not lm-eval's seeds"):
        Seeds.parse(given)


@pytest.mark.parametrize(("kwargs", "sampled"), [
    ({"do_sample": True, "temperature": 0.7}, True),
    ({"temperature": 0.7}, True),  # do_sample not given: a temperature above 0 samples (lm-eval's reading)
    ({"do_sample": False, "temperature": 0.7}, False),  # do_sample false: greedy, the temperature ignored
    ({"temperature": 0.0}, False),
    ({"until": ["\n"]}, False),
])
def test_what_samples_is_lm_evals_reading(kwargs: dict[str, Any], sampled: bool) -> None:
    assert samples(kwargs) == sampled
    assert bool(honoured(kwargs, "--gen_kwargs").get("do_sample")) == sampled


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"do_sample": True}, "do_sample=True with temperature 0"),
    ({"num_beams": 4}, "gen_kwargs num_beams=4: resumerge does not honour it"),
    ({"do_sample": True, "temperature": 1.0, "min_p": 0.1}, "min_p=0.1"),
])
def test_a_generation_kwarg_not_honoured_is_named(kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(UsageError, match=said.replace("(", r"\(")):
        honoured(kwargs, "--gen_kwargs")


def test_a_no_op_kwarg_is_accepted() -> None:
    assert honoured({"num_beams": 1, "repetition_penalty": 1.0}, "--gen_kwargs")["max_gen_toks"] == 256


def _drawn(want: Wanted, seed: int, steps: int, logits: torch.Tensor) -> list[int]:
    return [want.choose(logits[step], seed, [0] * step) for step in range(steps)]  # the tokens made: any


def test_each_draw_is_the_seeds_the_requests_and_the_steps_alone() -> None:
    logits = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    how = Sampling(temperature=1.5, top_k=0)
    one, other = Wanted((3, 4, 5), (), 12, how, 0), Wanted((3, 4, 6), (), 12, how, 0)
    first = _drawn(one, 1234, 12, logits)
    _drawn(other, 1234, 12, logits)  # drawing for another request between changes nothing
    assert _drawn(one, 1234, 12, logits) == first
    assert [one.choose(logits[s], 1234, [1] * s) for s in reversed(range(12))] == first[::-1]  # nor the order
    assert _drawn(one, 7, 12, logits) != first  # another seed draws otherwise
    assert _drawn(Wanted((3, 4, 5), (), 12, how, 0, nth=1), 1234, 12, logits) != first  # a repeat draws its own
    assert _drawn(Wanted((3, 4, 5), (), 12, None, 0), 1234, 12, logits) == [int(r.argmax()) for r in logits]


def test_top_k_and_top_p_keep_what_transformers_keeps() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    for top_k, top_p in ((5, 1.0), (0, 0.6), (10, 0.3)):
        theirs = logits[None].clone()
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        kept = {int(i) for i in torch.nonzero(theirs[0] > float("-inf"))}
        drawn = {Sampling(1.0, top_k, top_p).draw(logits, seed) for seed in range(400)}
        assert drawn <= kept and len(drawn) > 1
