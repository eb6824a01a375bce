"""The importance pass (``run --imatrix-texts``, a size target's costs) on the census families whose forward computes
a step's input from earlier outputs rather than handing it the previous step's output as it is: Dory's loop start
(the previous output's norm plus the input section's), HRM's (its L module's and H module's inputs summed between
the stacks' runs), XLM's norms (its layers' parts are steps: the residual sum before each layer_norm1 and
layer_norm2), found by :mod:`resumerge.forward.engine.handed` (a call's ``entering``). Inkling 2 loop's loop start
is one too, but the pass cannot run its experts (their activation takes the gate and up apart): it is the census
bench's row (bench/bench_importance_census.py).

The sums were right: the pass runs each step with :meth:`~resumerge.forward.engine.stream.ModelStream.run`, which
computes that input again. These stay as the guard, against transformers' own forward hooked before every linear
(:mod:`importance_oracle`), with families ``run --imatrix-texts`` accepts beside them. A size target's measurement
was not: it ran the layer again on the previous output as it is, so at Dory's second loop start the layer with its
own weights made an error of 0.0295 (the costs of every matrix of that layer about equal, that error's) and a gain of
356 where the others' are about 1.4."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from census import make_census_model, texts_of
from importance_oracle import differences, hooked_sums, pass_found, unsummed
from support import cli

from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

ORACLE = Path(__file__).parent / "importance_oracle.py"
# the census families whose forward computes a step's input (and Inkling 2 loop's, which the pass cannot run)
ENTERED = ("dory", "hrm_text", "xlm")
# families run --imatrix-texts accepts (it names their weights as a GGUF does), a dense one and a mixture of experts
ACCEPTED = ("llama", "qwen3_moe", "gemma3_text")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


@pytest.mark.slow
@pytest.mark.parametrize("family", ENTERED + ACCEPTED)
def test_the_pass_sums_what_transformers_forward_gives_each_linear(family: str, tmp_path: Path) -> None:
    """Per linear of the decoder layers, the float64 sums of its input's squares over every position of the texts:
    transformers' forward of the same model over the same ids, hooked before every ``nn.Linear`` and router, gives
    the same (every one but the head's; a looped layer's over each of its calls)."""
    model = make_census_model(tmp_path / "model", family, 1)
    texts = texts_of(family)
    sums = pass_found(model, texts, tmp_path / "state")[0]
    hooked = hooked_sums(model, texts)
    dense = {name: value for name, value in sums.items() if value.dim() == 1}  # (fused experts' per expert: no Linear)
    assert dense and not unsummed(hooked, dense)
    assert max(differences(dense, hooked).values()) < 1e-12


def _layer_inputs(model: Path, texts: list[list[int]], prefixes: set[str]) -> dict[str, list[list[torch.Tensor]]]:
    """transformers' forward of ``model`` over ``texts`` (each alone): the hidden states each decoder layer named by
    a prefix of ``prefixes`` is given, per call of it (a looped layer's), per text."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    seen: dict[str, list[torch.Tensor]] = {p: [] for p in prefixes}
    for prefix in prefixes:
        def given(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], key: str = prefix) -> None:
            seen[key].append((args[0] if args else kwargs["hidden_states"]).detach().clone())
        reference.get_submodule(prefix.rstrip(".")).register_forward_pre_hook(given, with_kwargs=True)
    per_text: dict[str, list[list[torch.Tensor]]] = {p: [] for p in prefixes}
    with torch.no_grad():
        for ids in texts:
            for p in prefixes:
                seen[p].clear()
            reference(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
            for p in prefixes:
                per_text[p].append(list(seen[p]))
    return {p: [list(calls) for calls in zip(*texts_calls, strict=True)] for p, texts_calls in per_text.items()}


@pytest.mark.slow
def test_a_size_targets_measurement_reruns_each_step_on_the_input_its_forward_gives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each Dory step's layer run again (its matrices' costs, its gain) is given what transformers' forward gives
    that call of the layer (its second loop start: the first loop's output normed, plus the input section's); run
    again with its own weights, its output is its own (error 0)."""
    from resumerge.analyses.importance.sums import SumStep

    measured: list[tuple[str, list[torch.Tensor], float]] = []
    measure = SumStep._measure

    def watched(self: SumStep, prefix: str, linears: Any, tokens: int, rerun: Any) -> None:
        _, module = linears[0]
        measured.append((prefix, [h.clone() for h in rerun.texts], rerun.error(module, module.weight.data)))
        measure(self, prefix, linears, tokens, rerun)

    monkeypatch.setattr(SumStep, "_measure", watched)
    model = make_census_model(tmp_path / "model", "dory", 1)
    texts = texts_of("dory")
    pass_found(model, texts, tmp_path / "state", costs=True)
    assert [p for p, _, _ in measured] == [f"model.layers.{i}." for i in (0, 1, 2, 1, 2, 3)]  # (two loops of 1, 2)
    given = _layer_inputs(model, texts, {p for p, _, _ in measured})
    calls = {p: 0 for p in given}
    for prefix, inputs, own_error in measured:
        expected = given[prefix][calls[prefix]]
        calls[prefix] += 1
        assert own_error == 0.0  # (before, 0.0295 at the second loop start)
        assert len(inputs) == len(texts)
        for found, want in zip(inputs, expected, strict=True):
            assert float((found - want).abs().max()) < 1e-5, prefix


def _found(family: str, model: Path, state: Path, env: dict[str, str]) -> Any:
    """The pass over ``model`` measuring a size target's costs, in a process of its own (under ``env``)."""
    out = state.parent / f"{state.name}.pt"
    done = cli(out, family, model, state, "costs", script=ORACLE, env=env, timeout=600)
    return done, (torch.load(out) if out.is_file() else None)


@pytest.mark.slow
def test_a_pass_killed_before_a_loop_start_resumes_to_the_same_sums_and_costs(tmp_path: Path) -> None:
    """The pass over Dory measuring a size target's costs, killed (SIGKILL, a real process) once step 2 is durable,
    run again: it resumes at step 3, the second loop start, whose input it computes from the input section's output
    the journal kept, and ends with the sums, counts and costs of a pass never killed, bit for bit."""
    model = make_census_model(tmp_path / "model", "dory", 1)
    whole = dict(zip(("sums", "counts", "costs"), pass_found(model, texts_of("dory"), tmp_path / "whole", costs=True),
                     strict=True))
    killed, _ = _found("dory", model, tmp_path / "killed", {"RESUMERGE_KILL_AT": "after_imatrix_layer:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done, resumed = _found("dory", model, tmp_path / "killed", {})
    assert done.returncode == 0, done.stderr
    for part in ("sums", "counts", "costs"):
        assert whole[part].keys() == resumed[part].keys()
        assert all(torch.equal(whole[part][n], resumed[part][n]) for n in whole[part]), part
    assert whole["costs"]
