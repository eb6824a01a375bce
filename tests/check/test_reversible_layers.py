"""A forward whose layers return an object it reads by attribute, each a stream of its own (Reformer's reversible
layers return ``attn_output`` and ``hidden_states``; the next layer takes both, and the forward after the last puts
the two side by side before its LayerNorm, then cuts off the positions it padded to a multiple of its chunk length):
``check``'s capture stands an object for each layer's output whose every attribute read is traced
(resumerge.forward.engine.handed.Reads), the one the next call takes as its hidden states the pass's hidden output, the
others handed on as any layer's extra outputs and journaled while a later call or the last hidden state reads them.
Its forward pads the positions to a multiple of its chunk length itself: a text runs alone, and the figures are taken
over the tokens' positions among those the hidden states hold (CPM-Ant's hold its prompt's before them: ``check
--base`` of it crashed). Before, ``check`` refused Reformer in one line ("reformer runs its layers as a reversible
pair of streams")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from census import make_census_model

from resumerge import api
from resumerge.cli.modelgen import write_tokenizer
from tests.check.test_looped_layers import killed_and_resumed

pytest.importorskip("transformers")


@pytest.mark.slow
# between two layers, with no hash_seed (its LSH attention's rotations drawn at random: each layer's draws are seeded,
# the same again on a resumed pass), and after the last (the last hidden state reads both streams)
@pytest.mark.parametrize(("kill", "hash_seed"), [(2, None), (4, 7)])
def test_a_killed_check_of_reformer_resumes_with_its_second_stream(tmp_path: Path, kill: int,
                                                                    hash_seed: int | None) -> None:
    merge, base = (make_census_model(tmp_path / role, "reformer", seed) for role, seed in (("merge", 1), ("base", 2)))
    for model in (merge, base):
        doc = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**doc, "hash_seed": hash_seed}))
        write_tokenizer(model, 128)
    carried, doc, same = killed_and_resumed(tmp_path, merge, base, kill)
    assert carried  # each batch's attention stream, which the next call takes
    assert doc == same and len(doc["models"][1]["drift"]) == 4


def test_the_real_positions_are_the_tokens_among_those_the_hidden_states_hold() -> None:
    import torch

    from resumerge.forward.text.batches import Entered

    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    plain = Entered([[0, 1]], [(torch.zeros(2, 3, dtype=torch.long), mask)], [[torch.zeros(2, 3, 4)]])
    assert plain.real()[0].tolist() == mask.bool().tolist()
    # Reformer's own padding to its chunk length after the tokens; CPM-Ant's prompt before them
    padded = Entered([[0, 1]], [(torch.zeros(2, 3, dtype=torch.long), mask)], [[torch.zeros(2, 5, 4)]])
    assert padded.real()[0].tolist() == [[True, True, True, False, False], [True, True, False, False, False]]
    assert padded.real(2)[0].tolist() == [[False, False, True, True, True], [False, False, True, True, False]]


@pytest.mark.slow
def test_check_with_a_base_of_cpmant_takes_its_figures_over_the_tokens_beside_its_prompt(tmp_path: Path) -> None:
    # (its layers' hidden states hold its prompt's positions before the tokens': the drift's selection of the real
    # positions crashed, "The shape of the mask [1, 43] at index 1 does not match … [1, 75, 32]")
    merge, base = (make_census_model(tmp_path / role, "cpmant", seed) for role, seed in (("merge", 1), ("base", 2)))
    for model in (merge, base):
        write_tokenizer(model, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world, and a longer line of words than the others\n")
    found = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    drift = found.to_json()["models"][1]["drift"]
    assert len(drift) == 4 and all(0 < d < 10 for d in drift)
