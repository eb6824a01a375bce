"""The census of issue 96: every decoder-only text family the installed transformers builds (tests/census.py), each
as two tiny models shrunk from its config class's defaults, merged linear (exact, its config.json read by
transformers as the inputs', every weight placed), sliced a[0, 2) + b[2, 4) (every weight placed) and checked
(``check``'s NLL of the merge is transformers' own, each text alone). What does not work yet is written in
:data:`census.OPEN`, each with what it says: a family that starts working, or stops, fails here, and so does a
model type of a new transformers release until the census names it. docs/supported.md's family table is made from
the same tables (``python tests/census.py`` writes it again).

Before this, modernbert-decoder's merge wrote ``vocab_size`` from its head's inner ``dense`` (not loadable),
Dory's and HRM's merges were refused (Dory's config counts attention and MLP blocks apart; HRM runs two layer stacks
in turn), and ``check`` crashed on Falcon-H1 (its head reads the base model's ``lm_head_multiplier``), GPT-1 (its
layers return lists) and Zaya (the base model's own input scale and bias left unread).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from census import (
    CENSUS,
    COMPOSITE,
    NOT_BUILT,
    OPEN,
    census_markdown,
    census_row,
    make_census_model,
    model_types,
    tiny_config,
)
from support import write_config

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[1] / "docs" / "supported.md"


@pytest.fixture(autouse=True)
def _quiet() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def test_every_causal_lm_model_type_is_in_the_census_or_says_why_not() -> None:
    # a new transformers release's new family fails here until tests/census.py builds it (or says why not)
    types = set(model_types())
    assert types - set(CENSUS) - set(COMPOSITE) - set(NOT_BUILT) == set()
    assert not set(CENSUS) & (set(COMPOSITE) | set(NOT_BUILT))


def test_a_tiny_config_worked_out_once_is_handed_out_whole_each_time() -> None:
    # census._tiny_kwargs is cached per model type: a config given its lists must not share them with the next one
    # (a row's two models and its texts each ask; a class may keep, and a test may change, the list it was given)
    first = tiny_config("gpt_neo")
    first.attention_types[0][0].append("local")
    again = tiny_config("gpt_neo")
    assert again.attention_types == [[["global", "local"], 2]]
    assert again.to_dict() == tiny_config("gpt_neo").to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("family", CENSUS)
def test_the_family_merges_slices_and_checks(family: str, tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():  # transformers' own, on tiny configs (token ids past a tiny vocabulary, …)
        warnings.simplefilter("ignore")
        row = census_row(family, tmp_path)
    found = {aspect: said for aspect, said in row.items() if said != "ok"}
    expected = OPEN.get(family, {})
    assert found.keys() == expected.keys(), found
    for aspect, said in expected.items():
        assert said in found[aspect], found[aspect]


def test_a_stack_that_moves_a_layer_of_a_family_that_loops_or_shares_its_layers_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from resumerge.cli.commands import main

    for family, said in (("dory", "loops its middle layers"), ("zamba", "shares one transformer block"),
                         ("hrm_text", "runs its layer stacks"),
                         # (before: "layer_range [0, 2] is past the end of …, which has 0 layers")
                         ("xlm", "keeps its layers' parts in separate numbered lists (transformer.attentions, "
                                 "transformer.ffns, transformer.layer_norm1, transformer.layer_norm2)")):
        model = make_census_model(tmp_path / family, family, 1)
        config = write_config(tmp_path / f"{family}.yml", {"merge_method": "passthrough", "dtype": "float32",
                                                           "slices": [
            {"sources": [{"model": str(model), "layer_range": [0, 2]}]},
            {"sources": [{"model": str(model), "layer_range": [1, 3]}]}]})
        capsys.readouterr()
        assert main(["plan", str(config)]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and said in lines[0], lines


def test_supported_md_holds_the_census_table_made_from_the_census() -> None:
    # `python tests/census.py` writes it again
    text = DOC.read_text(encoding="utf-8")
    assert census_markdown() in text


def test_a_gpt_neo_stack_writes_attention_types_for_its_own_layers(tmp_path: Path) -> None:
    # GPT-Neo's config class expands attention_types into attention_layers and refuses a count other than num_layers:
    # the donor's [[["global", "local"], 2]] kept for a 3-layer stack made a config.json transformers would not read
    from census import config_doc, not_loaded, read_back
    from support import api_merge

    a, b = make_census_model(tmp_path / "a", "gpt_neo", 1), make_census_model(tmp_path / "b", "gpt_neo", 2)
    out = api_merge(tmp_path / "out", {"merge_method": "passthrough", "dtype": "float32", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(b), "layer_range": [1, 2]}]}]})
    doc = config_doc(out)
    assert doc["attention_types"] == [[["global"], 1], [["local"], 2]]
    assert doc["attention_layers"] == ["global", "local", "local"]
    model, info = read_back(out)
    assert model.config.attention_layers == ["global", "local", "local"] and not not_loaded(info)
