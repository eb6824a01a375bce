"""Tokenizer merges end to end: built tokenizers, aligned embeddings, chat templates, resume, loading.

The function-level rules are tested in ``tests/vocab`` (against mergekit's own code); here real merges of
generated models with different vocabularies go through the CLI and the outputs are checked row by row against
the inputs, loaded with transformers, compared with mergekit where its ids are deterministic, and killed and
resumed. Only killed runs start a process; the others run the CLI's ``main`` here (no Python and torch start-up).
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from mergekit_oracle import Mergekit
from safetensors.torch import load_file

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from tests.support import cli, digests, output_tensors
from tests.vocab.gen import make_tokenizer_dir

WORDS_A = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "again", "and", "again"]
WORDS_B = ["the", "lazy", "cat", "sleeps", "under", "the", "warm", "sun", "all", "day", "long", "again"]


def _model(root: Path, name: str, words: list[str], *, added: tuple[str, ...] = (), seed: int = 0,
           template: str | None = None, weights_seed: int = 1) -> Path:
    """A llama model whose tokenizer is a real BPE over ``words`` and whose embedding has one row per token."""
    tok = root / f"{name}-tokenizer"
    rows = make_tokenizer_dir(tok, words, added=list(added), seed=seed, chat_template=template)
    out = make_model(root / name, ModelSpec(layers=2, hidden=16, intermediate=32, vocab=rows, tokenizer=False),
                     seed=weights_seed)
    for f in tok.iterdir():
        shutil.copy(f, out / f.name)
    return out


def _vocab(directory: Path) -> dict[str, int]:
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    return vocab


def _config(path: Path, a: Path, b: Path, tail: str) -> Path:
    path.write_text(
        f"merge_method: linear\nbase_model: {a}\nmodels:\n"
        f"  - model: {a}\n    parameters: {{weight: 0.25}}\n"
        f"  - model: {b}\n    parameters: {{weight: 0.75}}\n" + tail
    )
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tok-models")
    a = _model(root, "a", WORDS_A, added=("<|im_start|>",), weights_seed=1)
    b = _model(root, "b", WORDS_B, added=("<extra>",), seed=3, weights_seed=2)
    return a, b


def test_union_aligns_every_row_and_pads(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    a, b = pair
    config = _config(tmp_path / "c.yml", a, b, "tokenizer:\n  source: union\n  pad_to_multiple_of: 16\n")
    out = tmp_path / "out"
    assert main(["run", str(config), str(out), "--quiet"]) == 0
    va, vb, vo = _vocab(a), _vocab(b), _vocab(out)
    assert set(vo) == set(va) | set(vb)
    real = len(vo)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == -(-real // 16) * 16
    ea, eb = output_tensors(a), output_tensors(b)
    merged = load_file(out / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = merged[name]
        assert rows.shape == (cfg["vocab_size"], 16)
        for token, i in vo.items():
            if token in va and token in vb:
                want = 0.25 * ea[name][va[token]] + 0.75 * eb[name][vb[token]]
            elif token in va:  # b lacks it: b's row is the base's (a is the base)
                want = ea[name][va[token]]
            else:  # a (the base) lacks it: only b has it, so a's row is b's
                want = eb[name][vb[token]]
            torch.testing.assert_close(rows[i], want, rtol=0, atol=1e-6, msg=f"{name} row {i} ({token!r})")
        torch.testing.assert_close(rows[real:], rows[:real].mean(0).expand(rows.shape[0] - real, -1))


def test_union_output_loads_and_chats_in_transformers(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    a, b = pair
    config = _config(tmp_path / "c.yml", a, b, "tokenizer_source: union\nchat_template: chatml\n")
    out = tmp_path / "out"
    assert main(["run", str(config), str(out), "--quiet"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    text = tok.apply_chat_template([{"role": "user", "content": "the lazy cat"}], tokenize=False)
    assert text.startswith("<|im_start|>user\nthe lazy cat<|im_end|>")
    ids = tok("the lazy cat <extra> jumps")["input_ids"]
    assert max(ids) < model.config.vocab_size and tok.convert_tokens_to_ids("<extra>") in ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape[-1] == model.config.vocab_size and bool(torch.isfinite(logits).all())


def test_base_source_matches_mergekit_tensor_for_tensor(tmp_path: Path, mergekit: Mergekit) -> None:
    """The same words with shuffled ids: aligning b to a's vocabulary must undo the shuffle exactly as mergekit
    does (no union, so mergekit's ids are deterministic)."""
    a = _model(tmp_path, "a", WORDS_A, weights_seed=1)
    b = _model(tmp_path, "b", [*WORDS_A, "sun"], seed=5, weights_seed=2)
    config = _config(tmp_path / "c.yml", a, b, "tokenizer_source: base\n")
    assert main(["run", str(config), str(tmp_path / "ours"), "--quiet"]) == 0
    mk = mergekit.run(config, tmp_path / "mk")
    assert mk.returncode == 0, mk.stderr[-2000:]
    ours, theirs = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "mk" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert _vocab(tmp_path / "ours") == _vocab(tmp_path / "mk")


def test_tokens_section_force_zero_and_model_token(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    a, b = pair
    va, vb = _vocab(a), _vocab(b)
    shared = sorted(t for t in set(va) & set(vb) if t.isalpha() and len(t) > 2)[0]
    donor = sorted(t for t in va if t.isalpha() and len(t) > 2)[-1]
    tail = (
        "tokenizer:\n  source: union\n  tokens:\n"
        f"    {shared}: {{source: {b}, force: true}}\n"
        "    <new>: {source: {kind: zero}}\n"
        f"    <copy>: {{source: {{kind: model_token, model: {a}, token: {donor}}}}}\n"
    )
    out = tmp_path / "out"
    assert main(["run", str(_config(tmp_path / "c.yml", a, b, tail)), str(out), "--quiet"]) == 0
    vo = _vocab(out)
    ea, eb = output_tensors(a), output_tensors(b)
    rows = output_tensors(out)["model.embed_tokens.weight"]
    e = "model.embed_tokens.weight"
    # forced: every model uses b's row, so the weighted sum is b's row itself
    torch.testing.assert_close(rows[vo[shared]], eb[e][vb[shared]], rtol=0, atol=1e-6)
    assert torch.count_nonzero(rows[vo["<new>"]]) == 0
    torch.testing.assert_close(rows[vo["<copy>"]], ea[e][va[donor]], rtol=0, atol=1e-6)


def test_chat_template_reaches_a_copied_tokenizer(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    a, _b = pair
    out = tmp_path / "out"
    tail = "chat_template: \"{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\\n{% endfor %}\"\n"
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 1.0}}\n" + tail)
    assert main(["run", str(config), str(out), "--quiet"]) == 0
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (out / "chat_template.jinja").read_text() == template
    assert (out / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_union_merge_killed_and_resumed_is_identical(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    a, b = pair
    config = _config(tmp_path / "c.yml", a, b, "tokenizer_source: union\n")
    ref = tmp_path / "ref"
    assert main(["run", str(config), str(ref), "--out-shard-size", "5k", "--quiet"]) == 0
    for point in ("after_ledger_commit:2", "during_tokenizer_write:1"):
        out = tmp_path / f"out-{point}"
        state = tmp_path / f"state-{point}"
        killed = cli("run", config, out, "--out-shard-size", "5k", "--state-dir", state, "--quiet",
                     env={"RESUMERGE_KILL_AT": point})
        assert killed.returncode == -signal.SIGKILL, point
        assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
        assert digests(out) == digests(ref)


def test_different_vocabularies_without_a_tokenizer_say_how_to_align(tmp_path: Path, pair: tuple[Path, Path],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pair
    assert main(["run", str(_config(tmp_path / "c.yml", a, b, "")), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Tensor size mismatch" in err and "tokenizer_source: base" in err
    assert not (tmp_path / "out").exists()
