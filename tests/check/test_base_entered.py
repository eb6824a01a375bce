"""``check --base``'s departure of a step is taken on the base's input to it as the base's forward gives it.

Where the forward computes a step's input from earlier outputs rather than handing it the previous step's output as
it is (XLM with ``causal: true``, followed part by part: its layer_norm1 takes the attention's input plus its output,
its layer_norm2 the feed-forward's input plus its output), the merge's step was given the base's previous step's
output as it is, the residual sum skipped: its departure measured another function. The figures here are those of
transformers' own forward of the base, each part's input and output hooked, the merge's part run on that input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from census import make_census_model

from resumerge import api
from resumerge.cli.modelgen import write_tokenizer

pytest.importorskip("transformers")

TEXT = "the cat sat on the mat"


def hooked_departures(merge: Path, base: Path) -> dict[int, float]:
    """Per step of XLM's parts (attention, layer_norm1, ffns, layer_norm2 of each layer, in that order), where the
    part is a function of its input alone: ‖merge's part − base's part‖ / ‖base's part − its input‖ on the input the
    base's forward gives the part."""
    import torch
    from transformers import AutoTokenizer, XLMWithLMHeadModel

    ids = AutoTokenizer.from_pretrained(base)(TEXT, return_tensors="pt")["input_ids"]
    base_model, merge_model = (XLMWithLMHeadModel.from_pretrained(m).eval() for m in (base, merge))
    parts = ("layer_norm1", "ffns", "layer_norm2")  # (steps 1, 2, 3 of each layer's four)
    seen: dict[tuple[str, int], torch.Tensor] = {}
    for i in range(base_model.config.n_layers):
        for part in parts:
            getattr(base_model.transformer, part)[i].register_forward_hook(
                lambda _m, args, out, key=(part, i): seen.__setitem__(key, args[0].detach().clone()))
    found = {}
    with torch.no_grad():
        base_model(ids)
        for (part, i), x in seen.items():
            own = getattr(base_model.transformer, part)[i](x)
            theirs = getattr(merge_model.transformer, part)[i](x)
            found[4 * i + 1 + parts.index(part)] = float((theirs - own).norm() / (own - x).norm())
    return found


@pytest.mark.slow
def test_check_base_departures_of_xlms_norms_are_taken_on_the_residual_sum_the_forward_gives_them(
    tmp_path: Path,
) -> None:
    merge, base = (make_census_model(tmp_path / role, "xlm", seed) for role, seed in (("merge", 1), ("base", 2)))
    for model in (merge, base):
        write_tokenizer(model, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXT + "\n")  # (one text: no padding, every position real in both)
    report = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    depart = json.loads(json.dumps(report.to_json()))["models"][1]["depart"]
    expected = hooked_departures(merge, base)
    assert len(depart) == 16 and len(expected) == 12
    # (before, the norms' were off: layer 0's layer_norm1 1.3438 for 1.3447, layer 1's 1.3414 for 1.0736; the
    # feed-forwards' were right: they take the norm's output as it is)
    assert {k: round(depart[k], 5) for k in expected} == {k: round(v, 5) for k, v in expected.items()}
