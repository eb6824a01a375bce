"""XLNet and XLM in their causal modes, which ``check`` follows, and as their defaults are, which it refuses.

XLNet with ``attn_type: uni``: its forward holds the hidden states positions first, the batch second (the pass holds
them batch first and hands each layer them as the forward does), its layers return the query stream beside them, None
without a target mapping, which the forward tests for None after the last layer (the capture's stand-in returns what
the layer returns, in its shape, found by running it without weights: resumerge.forward.engine.standins.AS_BUILT), and
its forward cannot make a padded batch's calls (its causal mask takes the padding mask in place: transformers' own
forward fails on it), so its texts run one at a time. XLM with ``causal: true``: no module runs a layer whole (its
forward's loop body calls four lists' parts, attentions, layer_norm1, ffns, layer_norm2, with residual sums and its
padding mask between them), so each part is a step, what the forward computes between them computed again from the
pass's outputs; it writes keys into a cache its forward makes unasked, which each run gets afresh. Before, ``check``
refused both. Their defaults, and every published checkpoint of them, attend both ways (XLNet's ``bi``, XLM's masked
LM): no next-token predictions, refused in one line naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from census import make_census_model, tiny_config
from support import cli

from resumerge.cli.modelgen import write_tokenizer
from tests.check.test_looped_layers import killed_and_resumed

pytest.importorskip("transformers")


@pytest.mark.slow
# XLNet between two layers; XLM after its fifth step (layer 1's attention: its layer_norm1 then takes the attention's
# input, layer 0's output, plus its output) and after its eighth (layer 1's layer_norm2, whose output layer 2's
# layer_norm1 takes again beside its attention's)
@pytest.mark.parametrize(("family", "kill"), [("xlnet", 2), ("xlm", 5), ("xlm", 8)])
def test_a_killed_check_of_a_causal_xlnet_or_xlm_resumes_to_the_same_report(tmp_path: Path, family: str,
                                                                             kill: int) -> None:
    merge, base = (make_census_model(tmp_path / role, family, seed) for role, seed in (("merge", 1), ("base", 2)))
    for model in (merge, base):
        write_tokenizer(model, 128)
    carried, doc, same = killed_and_resumed(tmp_path, merge, base, kill)
    if family == "xlm":  # (what the forward sums with the next part's output: the output of the part before it)
        assert carried
    steps = 4 if family == "xlnet" else 16  # (XLM: a step per part)
    assert doc == same and len(doc["models"][1]["drift"]) == steps


@pytest.mark.parametrize(("family", "key", "value", "said"), [
    ("xlnet", "attn_type", "bi", "xlnet attends both ways unless its attn_type is uni"),
    ("xlm", "causal", False, "xlm attends both ways unless its config says causal"),
])
def test_check_of_an_xlnet_or_xlm_as_its_defaults_are_is_refused_in_one_line(
    tmp_path: Path, family: str, key: str, value: object, said: str
) -> None:
    # (its defaults: each position's logits read the tokens after it; before, XLM's refusal named its four lists)
    assert getattr(tiny_config(family).__class__(), key) == value
    model = make_census_model(tmp_path / family, family, 1)
    doc = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**doc, key: value}))
    write_tokenizer(model, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n")
    found = cli("check", model, "--prompts", texts, "--state-dir", tmp_path / "state")
    lines = [line for line in found.stderr.splitlines() if line.strip()]
    assert found.returncode == 2 and len(lines) == 1 and said in lines[0], found.stderr[-2000:]


def test_the_budget_of_an_xlm_check_holds_its_largest_part_as_a_step(tmp_path: Path) -> None:
    # (its steps are parts in four lists: the steps' bytes were those of "transformer.attentions.i." alone)
    from resumerge.analyses.check.models import Checked
    from resumerge.config.modelref import ModelRef
    from resumerge.forward.compared.needs import step_bytes
    from resumerge.forward.compared.passes import streams_of
    from resumerge.inputs.model import open_model

    model = make_census_model(tmp_path / "xlm", "xlm", 1)
    (stream,) = streams_of([Checked("xlm", str(model), None, open_model(ModelRef(str(model)), directory=model))])
    with stream:
        ffn = sum(p.numel() * 4 for p in stream.layers_list[2].parameters())
        assert [stream.prefix(m) for m in stream.layers_list[:4]] == [
            "transformer.attentions.0.", "transformer.layer_norm1.0.", "transformer.ffns.0.",
            "transformer.layer_norm2.0."]
        assert step_bytes([stream], [[5] * 9]).decoder[0] >= ffn


def test_hidden_states_positions_first_are_told_from_the_ids_the_embeddings_were_given() -> None:
    import torch

    from resumerge.forward.engine.tail import positions_first

    ids = torch.tensor([[3, 4, 5], [6, 7, 8], [9, 10, 11]])  # (three sequences of three: the sizes tell nothing)
    first = torch.zeros(3, 3, 8)
    assert positions_first(first, ids, [ids.transpose(0, 1)])  # XLNet's: the ids transposed before anything
    assert not positions_first(first, ids, [ids])
    assert positions_first(torch.zeros(3, 2, 8), ids[:2], [])  # (two sequences of three, positions first)
    assert not positions_first(torch.zeros(2, 3, 8), ids[:2], [])
    # (Gemma 3n's four streams first, then the batch: two sequences of four)
    assert not positions_first(torch.zeros(4, 2, 4, 8), torch.arange(8).view(2, 4), [])


def test_texts_run_one_at_a_time_where_the_forward_cannot_make_a_padded_batchs_calls() -> None:
    import torch

    from resumerge.forward.text.batches import enter

    def entering(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[torch.Tensor]]:
        if any(len(ids) > 1 for ids, _ in batches):  # (XLNet's, attn_type uni: its mask takes no padded batch)
            raise RuntimeError("output with shape [30, 30, 1, 1] doesn't match the broadcast shape [30, 30, 3, 1]")
        return [[torch.zeros(*ids.shape, 4) for ids, _ in batches]]

    found = enter([[3, 4, 5], [6, 7]], entering, lambda: True)
    assert found.groups == [[0], [1]]
    with pytest.raises(RuntimeError):  # a sequence alone that fails is the forward's own failure
        enter([[3, 4, 5]], lambda batches: entering([(torch.zeros(2, 3), m) for _, m in batches]), lambda: True)
