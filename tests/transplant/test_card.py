"""A transplant's model card speaks of a transplant, not a merge: its own title, lead, method heading, each model's
role, the account of its tokens in a section of its own (not repeated under Notes) and its options as JSON."""

from __future__ import annotations

from pathlib import Path

from resumerge import api
from resumerge.api.options import Surgery
from transplant.pairs import make_pair


def test_transplant_card_has_its_own_wording(tmp_path: Path) -> None:
    model, donor = make_pair(tmp_path / "pair")
    api.tokensurgeon(str(model), str(donor), tmp_path / "out", surgery=Surgery(k=8, new_vocab_scale=0.5),
                     settings=api.Settings(state_dir=tmp_path / "state"))
    card = (tmp_path / "out" / "README.md").read_text()
    lines = card.splitlines()
    assert f"# {model} with {donor}'s tokenizer" in lines
    assert "Merged model" not in card and "This is a merge" not in card and "## Merge method" not in card
    assert "## Transplant method" in lines
    assert f"`{model}` (local, MODEL: its weights)" in card and f"`{donor}` (local, DONOR: its tokenizer)" in card
    assert "base model" not in card
    assert f"`resumerge tokensurgeon {model} {donor} OUT -a omp --k 8 --new-vocab-scale 0.5`" in card
    tokens = card.split("## Tokens", 1)[1].split("\n## ", 1)[0]
    assert "- tokensurgeon token embedding: 294 rows, 212 shared (copied), 82 approximated by omp (k=8)" in tokens
    assert "- tokensurgeon head: 294 rows" in tokens
    assert card.count("212 shared (copied)") == 2  # once per matrix, not again under Notes
    assert "YAML" not in card and "```json\n{\n  \"tokensurgeon\"" in card
    assert "- tokensurgeon" in card.split("---", 2)[1]  # a tag of its own



def test_the_card_records_the_output_flags_of_the_run(tmp_path: Path) -> None:
    """The card's command line reproduces the run: its seed and shard size too (before, only the transplant's own
    options); a GGUF output's format: test_gguf."""
    model, donor = make_pair(tmp_path / "pair")
    api.tokensurgeon(str(model), str(donor), tmp_path / "out", surgery=Surgery(approximation_method="randn"),
                     settings=api.Settings(output=api.Output(out_shard_size="100kB"),
                                           merging=api.Merging(random_seed=7), state_dir=tmp_path / "state"))
    card = (tmp_path / "out" / "README.md").read_text()
    assert (f"`resumerge tokensurgeon {model} {donor} OUT -a randn --out-shard-size 100000 --random-seed 7`"
            in card), card


def test_a_check_against_model_is_quoted_in_the_transplants_card(tmp_path: Path) -> None:
    """``resumerge check OUT --base MODEL`` over texts made of tokens both tokenizers hold: the shared tokens'
    predictions are MODEL's (KL ~ 0, top-1 100 %), and the card's section says what that means for a transplant and
    how the vocabularies met."""
    import json

    from resumerge.analyses.check.card import TRANSPLANT_LEAD

    model, donor = make_pair(tmp_path / "pair")
    out, state = tmp_path / "out", tmp_path / "state"
    api.tokensurgeon(str(model), str(donor), out, surgery=Surgery(k=8), settings=api.Settings(state_dir=state))
    mine = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    theirs = json.loads((donor / "tokenizer.json").read_text())["model"]["vocab"]
    shared = sorted(t for t in mine if t in theirs and not t.startswith("<"))
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(" ".join(shared[(7 * i + j) % len(shared)] for j in range(12)) for i in range(6)))
    report = api.check(out, base=model, prompts=texts, settings=api.Settings(state_dir=state))
    base = report.models[1]
    assert base.kl is not None and abs(base.kl) < 1e-6 and base.top1 == 1.0
    card = (out / "README.md").read_text()
    section = card.split("## Check", 1)[1]
    assert TRANSPLANT_LEAD in section
    assert "- Vocabularies: " in section and "tokens shared" in section.split("- Vocabularies: ", 1)[1], section
