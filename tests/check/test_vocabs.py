"""Models whose vocabularies differ (issue 70): a check of a merge with more rows than its parents (a
``tokenizer_source: union`` merge), or of models whose tokenizers number the same tokens differently, compares them
over the tokens they share and says how many; models that share no token are refused in one line, exit 2, before
any layer runs (nothing journaled). Before, every layer of every model ran and the heads crashed (exit 1).

Tiny generated models (two layers, width 32, a byte-level tokenizer): each check is a second or two."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support import cli

from resumerge import api
from resumerge.analyses.check.report import CheckReport
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import UsageError

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
TEXTS = "the cat sat on the mat\nhello world again\n"


def _texts(root: Path) -> Path:
    path = root / "texts.txt"
    path.write_text(TEXTS)
    return path


def _renumbered(directory: Path, rename: dict[str, str] | None = None, reverse: bool = False) -> Path:
    """``directory``'s tokenizer with its tokens renamed (``rename``) or its plain tokens' ids reversed
    (``reverse``: the same strings, other ids)."""
    path = directory / "tokenizer.json"
    doc = json.loads(path.read_text())
    vocab: dict[str, int] = doc["model"]["vocab"]
    if reverse:
        plain = sorted((i, t) for t, i in vocab.items() if i >= 3)
        ids = [i for i, _ in plain]
        vocab = {**{t: i for t, i in vocab.items() if i < 3}, **{t: i for (_, t), i in zip(plain, reversed(ids))}}
    if rename is not None:
        vocab = {rename.get(t, t): i for t, i in vocab.items()}
        doc["model"]["merges"] = []
        for entry in doc["added_tokens"]:
            entry["content"] = rename.get(entry["content"], entry["content"])
    doc["model"]["vocab"] = vocab
    path.write_text(json.dumps(doc))
    return directory


def _finite(report: CheckReport) -> None:
    for m in report.models:
        assert m.nll is not None and math.isfinite(m.nll)
        if m.role != "merge":
            assert m.kl is not None and math.isfinite(m.kl) and m.kl > -1e-6 and m.top1 is not None


def test_a_merge_whose_vocabulary_extends_its_parents_is_compared_over_the_shared_tokens(tmp_path: Path) -> None:
    base = make_model(tmp_path / "base", SPEC, seed=0)
    parent = make_model(tmp_path / "parent", SPEC, seed=1)
    merge = make_model(tmp_path / "merge", ModelSpec(layers=2, hidden=32, intermediate=48, vocab=80), seed=2)
    report = api.check(merge, base=base, parents=[parent], prompts=_texts(tmp_path),
                       settings=api.Settings(state_dir=tmp_path / "state"))
    assert report.shared_tokens == 64
    assert report.vocabulary is not None and "64 tokens shared" in report.vocabulary
    assert "the merge's 80" in report.vocabulary and "by id" in report.vocabulary
    _finite(report)
    # The same check asked again answers from its report, the count with it.
    again = api.check(merge, base=base, parents=[parent], prompts=_texts(tmp_path),
                      settings=api.Settings(state_dir=tmp_path / "state"))
    assert again.shared_tokens == 64 and again.vocabulary == report.vocabulary


def test_models_whose_tokenizers_number_tokens_differently_are_matched_by_token_string(tmp_path: Path) -> None:
    # The parent is the base with its tokenizer's ids reversed and its embedding and head rows permuted alike:
    # the same model, the same predictions; matched by string, its KL from the base is 0 and top-1 agrees fully.
    from safetensors.torch import load_file, save_file

    base = make_model(tmp_path / "base", SPEC, seed=0)
    merge = make_model(tmp_path / "merge", SPEC, seed=0)
    parent = _renumbered(make_model(tmp_path / "parent", SPEC, seed=0), reverse=True)
    order = list(range(3)) + list(reversed(range(3, 64)))  # row i of the parent holds the base's row order[i]
    for shard in parent.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                tensors[name] = tensors[name][order].contiguous()
        save_file(tensors, str(shard), metadata={"format": "pt"})
    report = api.check(merge, base=base, parents=[parent], prompts=_texts(tmp_path),
                       settings=api.Settings(state_dir=tmp_path / "state"))
    assert report.shared_tokens == 64
    assert report.vocabulary is not None and "by token string" in report.vocabulary
    _finite(report)
    found = {m.role: m for m in report.models}
    assert found["parent"].nll == pytest.approx(found["base"].nll, abs=1e-5)
    assert found["parent"].kl == pytest.approx(0.0, abs=1e-6) and found["parent"].top1 == 1.0


def test_models_that_share_no_token_are_refused_before_any_layer(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    base = make_model(tmp_path / "base", SPEC, seed=0)
    merge = make_model(tmp_path / "merge", SPEC, seed=1)
    vocab = json.loads((base / "tokenizer.json").read_text())["model"]["vocab"]
    other = _renumbered(make_model(tmp_path / "other", SPEC, seed=2), rename={t: f"x{t}" for t in vocab})
    state = tmp_path / "state"
    code = main(["check", str(merge), "--base", str(base), "--parent", str(other), "--prompts",
                 str(_texts(tmp_path)), "--state-dir", str(state)])
    err = capsys.readouterr().err
    assert code == 2
    assert "share no token" in err and len(err.strip().splitlines()) <= 2, err
    journaled = [p for p in state.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".json")]
    assert not [p for p in journaled if "tokens" not in p.parts], journaled  # no layer, no static pass, no report
    with pytest.raises(UsageError, match="share no token"):
        api.check(merge, base=base, parents=[other], prompts=_texts(tmp_path), settings=api.Settings(state_dir=state))


def test_a_text_holding_a_token_one_model_lacks_is_refused_naming_its_line(tmp_path: Path) -> None:
    # Neither vocabulary holds the other ("c" only the merge's, "k" only the base's): the merge's tokenizer cuts
    # the texts, and the one with "c" in it cannot be compared.
    merge = _renumbered(make_model(tmp_path / "merge", SPEC, seed=0), rename={"k": "κ"})
    base = _renumbered(make_model(tmp_path / "base", SPEC, seed=1), rename={"c": "ç"})
    texts = tmp_path / "texts.txt"
    texts.write_text("the dog sat\nthe cat sat\n")
    with pytest.raises(UsageError, match=r"line 2 of (--)?prompts .* holds the token 'c', which .*base lacks"):
        api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    assert not list((tmp_path / "state").rglob("*.safetensors"))


def test_run_check_of_a_union_merge_ends_with_its_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the merge was written, then its check ran every layer and crashed in the heads (exit 1).
    small = make_model(tmp_path / "small", SPEC, seed=0)
    large = make_model(tmp_path / "large", ModelSpec(layers=2, hidden=32, intermediate=48, vocab=80), seed=1)
    config = tmp_path / "union.yml"
    config.write_text(f"merge_method: linear\ntokenizer_source: union\nmodels:\n  - model: {small}\n"
                      f"    parameters: {{weight: 0.5}}\n  - model: {large}\n    parameters: {{weight: 0.5}}\n")
    out, state = tmp_path / "out", tmp_path / "state"
    code = main(["run", str(config), str(out), "--check", "--state-dir", str(state), "--quiet"])
    assert code in (0, 5), capsys.readouterr().err
    report = api.check(out,
                       settings=api.Settings(state_dir=state))  # the check run --check made, answered from its report
    assert report.shared_tokens == 64 and report.vocabulary is not None and "the merge's 80" in report.vocabulary


def test_a_killed_check_of_models_whose_vocabularies_differ_resumes_to_the_same_report(tmp_path: Path) -> None:
    base = make_model(tmp_path / "base", SPEC, seed=0)
    merge = make_model(tmp_path / "merge", ModelSpec(layers=2, hidden=32, intermediate=48, vocab=80), seed=2)
    texts = _texts(tmp_path)
    whole = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "whole"))
    state = tmp_path / "killed"
    argv = ["check", merge, "--base", base, "--prompts", texts, "--state-dir", state, "--json"]
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": "after_check_layer:1"}, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert [p.name for p in state.rglob("layer-*.safetensors")] == ["layer-00000.safetensors"]
    resumed = cli(*argv, timeout=300)
    assert resumed.returncode == whole.exit_code, resumed.stderr
    doc, expected = json.loads(resumed.stdout), json.loads(json.dumps(whole.to_json()))
    assert Path(doc.pop("chart")).read_bytes() == Path(expected.pop("chart")).read_bytes()
    assert doc == expected and doc["shared_tokens"] == 64


def test_a_text_holding_a_token_past_the_models_rows_is_refused_naming_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The tokenizer numbers a token (an added one) the embedding and head have no row for. Before: the check ran
    # its static pass and then torch's index error ended it inside the first layer ("cannot follow ... IndexError").
    model = make_model(tmp_path / "model", SPEC, seed=0)
    doc = json.loads((model / "tokenizer.json").read_text())
    doc["added_tokens"].append({"id": 64, "content": "<extra>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(doc))
    base = make_model(tmp_path / "base", SPEC, seed=1)
    (base / "tokenizer.json").write_text(json.dumps(doc))
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat\nthe <extra> dog\n")
    state = tmp_path / "state"
    code = main(["check", str(model), "--base", str(base), "--prompts", str(texts), "--state-dir", str(state)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "line 2 of --prompts" in err and "'<extra>' (id 64), past the 64 rows" in err, err
    assert "Traceback" not in err and "IndexError" not in err and len(err.strip().splitlines()) <= 2, err
    assert not list(state.rglob("*.safetensors"))
