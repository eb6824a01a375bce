"""A transplant across tokenizer families matches DONOR's tokens to MODEL's by the bytes each stands for (issue 85):
MODEL's tokenizer is a byte-level BPE (GPT-2's byte map, SmolLM2's layout), DONOR's a SentencePiece BPE with byte
fallback (``▁`` for a space, ``<0xNN>`` tokens, Gemma's layout), both trained here with ``tokenizers``.

mergekit-tokensurgeon 0.1.5 matches token strings, so it approximates tokens MODEL holds written otherwise
(``▁café`` is ``ĠcafÃ©``, ``<0x0A>`` is ``Ċ``) and copies a row of other bytes where the strings agree (DONOR's
piece ``Ċ`` is the two bytes C4 8A, MODEL's ``Ċ`` a newline; DONOR's ``¡`` is C2 A1, MODEL's ``¡`` the byte A1).
With ``-a zero`` an approximated row is zero in both tools, so their outputs differ in exactly the rows of those
tokens, as many as the report counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from bytefallback import byte_fallback_bpe, byte_level_bpe
from mergekit_oracle import Mergekit
from support import output_tensors

from resumerge import api
from resumerge.api.options import Surgery
from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "sat", "on", "mat", "café", "résumé", "naïve", "über", "straße", "hello", "world", "¡hola",
         "Ċ", "dog", "ran", "far", "away"]
CORPUS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8)) + ("\n" if i % 3 else "    x")
          for i in range(60)]
SPECIALS = ["<unk>", "<s>", "</s>"]
EMBED = "model.embed_tokens.weight"


def _byte_level() -> Any:
    return byte_level_bpe(CORPUS, ["</s>"], 420)


def _sentencepiece() -> Any:
    from tokenizers import decoders, pre_tokenizers

    tok = byte_fallback_bpe(CORPUS, SPECIALS, 220)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIALS)
    return tok


def _model(directory: Path, tok: Any, tokenizer_class: str, hidden: int, seed: int,
           specials: dict[str, str]) -> Path:
    make_model(directory, ModelSpec(layers=1, hidden=hidden, intermediate=48, vocab=tok.get_vocab_size(),
                                    tokenizer=False, shard_bytes=1 << 30), seed=seed)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class, **specials}))
    return directory


def _bytes_of_byte_level(token: str) -> bytes:
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # the peer's byte map, an oracle

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) else token.encode()


def _bytes_of_sentencepiece(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("▁", " ").encode()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("families")
    model = _model(root / "model", _byte_level(), "GPT2TokenizerFast", 48, 11, {"eos_token": "</s>"})
    donor = _model(root / "donor", _sentencepiece(), "LlamaTokenizerFast", 64, 12,
                   {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    return model, donor


def _rows_of_bytes(model: Path, donor: Path) -> dict[int, int]:
    """DONOR id -> MODEL's id of the same bytes (specials by content), decoded here from the files."""
    mine = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    theirs = json.loads((donor / "tokenizer.json").read_text())["model"]["vocab"]
    held: dict[bytes, int] = {}
    for token, i in sorted(mine.items(), key=lambda item: item[1]):
        held.setdefault(b"\xff" + token.encode() if token in SPECIALS else _bytes_of_byte_level(token), i)
    found = {}
    for token, i in theirs.items():
        key = b"\xff" + token.encode() if token in SPECIALS else _bytes_of_sentencepiece(token)
        if key in held:
            found[i] = held[key]
    return found


def _transplant(model: Path, donor: Path, out: Path) -> str:
    outcome = api.tokensurgeon(str(model), str(donor), out, surgery=Surgery(approximation_method="zero"),
                               settings=api.Settings(state_dir=out.parent / f"{out.name}-state"))
    assert outcome is not None
    return (out / "README.md").read_text()


def test_tokens_of_the_same_bytes_get_models_row(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Every DONOR token whose bytes MODEL holds gets MODEL's row of them: ``▁café`` ``ĠcafÃ©``'s, ``<0x0A>``
    ``Ċ``'s (a newline); DONOR's piece ``Ċ`` (C4 8A) not MODEL's newline row. The card says how many tokens 0.1.5
    would approximate or copy from another row."""
    model, donor = pair
    card = _transplant(model, donor, tmp_path / "out")
    source, out = output_tensors(model)[EMBED], output_tensors(tmp_path / "out")[EMBED]
    same = _rows_of_bytes(model, donor)
    for theirs, mine in same.items():
        assert torch.equal(out[theirs], source[mine]), (theirs, mine)
    mine_vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    theirs_vocab = json.loads((donor / "tokenizer.json").read_text())["model"]["vocab"]
    assert same[theirs_vocab["<0x0A>"]] == mine_vocab["Ċ"]
    assert same[theirs_vocab["▁café"]] == mine_vocab["ĠcafÃ©"]
    assert theirs_vocab["Ċ"] not in same or same[theirs_vocab["Ċ"]] != mine_vocab["Ċ"]
    assert not torch.equal(out[theirs_vocab["Ċ"]], source[mine_vocab["Ċ"]])
    # Every other row is approximated (zero here): no token is copied from a row of other bytes.
    approximated = [i for i in range(len(theirs_vocab)) if i not in same]
    assert not out[approximated].any()
    assert "mergekit-tokensurgeon 0.1.5 (by token string) would approximate" in card
    notes = api.status(tmp_path / "out",
                       settings=api.Settings(state_dir=tmp_path / "out-state")).to_json()["plan_notes"]
    assert any("0.1.5 (by token string) would approximate" in note for note in notes), notes


@pytest.mark.oracle
def test_mergekit_differs_in_exactly_the_rows_it_matches_by_string(pair: tuple[Path, Path], tmp_path: Path,
                                                                    mergekit: Mergekit) -> None:
    """0.1.5's output and resumerge's differ in the rows of the tokens the report counts (approximated by 0.1.5
    though MODEL holds their bytes, or copied by it from a row of other bytes) and in no other row."""
    model, donor = pair
    card = _transplant(model, donor, tmp_path / "ours")
    ran = mergekit.run(model, donor, tmp_path / "theirs", "-a", "zero", script="tokensurgeon")
    assert ran.returncode == 0, ran.stderr
    ours, theirs = output_tensors(tmp_path / "ours"), output_tensors(tmp_path / "theirs")
    assert ours.keys() == theirs.keys()
    matrices = {EMBED: "token embedding", "lm_head.weight": "head"}
    for name in ours:
        if name not in matrices:
            assert torch.equal(ours[name], theirs[name]), name
    same = _rows_of_bytes(model, donor)
    for name, label in matrices.items():
        differ = (ours[name] != theirs[name]).any(dim=1).nonzero().flatten().tolist()
        line = next(x for x in card.splitlines() if x.startswith(f"- tokensurgeon {label}:"))
        gained = int(line.split("would approximate ")[1].split(" ")[0])
        mended = int(line.split(" and copy ")[1].split(" ")[0])
        assert gained and mended
        assert len(differ) == gained + mended, (name, len(differ), gained, mended)
        source = output_tensors(model)[name]
        rows_of_model = {tuple(r.tolist()) for r in source}
        for row in differ:
            if row in same:  # resumerge copied MODEL's row of the same bytes, 0.1.5 another row or none
                assert torch.equal(ours[name][row], source[same[row]])
            else:  # 0.1.5 copied a row of other bytes, resumerge approximated it (zero)
                assert not ours[name][row].any() and tuple(theirs[name][row].tolist()) in rows_of_model
