"""A transplant reads a tokenizer.json with the ``tokenizers`` library alone where transformers 5 would build the same
tokenizer (issue 85: ~3.4 CPU s of Gemma 3's load saved): both paths give the same :class:`Vocabulary` (normalized
ids, byte forms, spelling) on tiny byte-level BPE and SentencePiece byte-fallback tokenizers (as
tests/transplant/test_bytes.py trains them) and on the real SmolLM2 / Gemma-3 pair, and so the same match of every
matrix (computed both ways on the tiny pair: a match reads only what the Vocabularies compare); a tokenizer whose
class rebuilds it, or whose configs name a special token tokenizer.json lacks, is loaded by transformers."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from bytefallback import byte_fallback_bpe, byte_level_bpe

from resumerge.runs.transplant.spec import SurgeryChoices
from resumerge.runs.transplant.tokens import (
    _DIRECT_CLASSES,
    Vocabulary,
    direct_vocabulary,
    load_vocabulary,
    match_matrix,
    vocabulary_of,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "sat", "on", "mat", "café", "résumé", "naïve", "über", "straße", "hello", "world", "¡hola",
         "Ċ", "dog", "ran", "far", "away"]
CORPUS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8)) + ("\n" if i % 3 else "    x")
          for i in range(60)]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def _byte_level(specials: list[str]) -> Any:
    return byte_level_bpe(CORPUS, specials, 420)


def _sentencepiece(specials: list[str]) -> Any:
    from tokenizers import decoders, normalizers, pre_tokenizers

    tok = byte_fallback_bpe(CORPUS, specials, 220)
    # Gemma's layout: spaces replaced by the normalizer, split on them, decoded back with byte fallback
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    return tok


def _folder(directory: Path, tok: Any, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _through_transformers(directory: Path) -> Vocabulary:
    return vocabulary_of(transformers.AutoTokenizer.from_pretrained(str(directory)))


def _same(direct: Vocabulary | None, slow: Vocabulary) -> None:
    assert direct is not None, "the tokenizer was not read directly"
    assert direct.ids == slow.ids
    assert list(direct.ids.items()) == list(slow.ids.items())  # the order decides batches too
    assert direct.spelling == slow.spelling
    assert direct.spelled == slow.spelled


def _digests(model: Vocabulary, donor: Vocabulary, model_rows: int, donor_rows: int) -> list[tuple[object, ...]]:
    found = []
    for choice in ("no", "yes"):
        choices = SurgeryChoices(prefix_match=choice, byte_match=choice)
        for matrix in ("embed", "lm_head"):
            m = match_matrix(model, donor, model_rows, donor_rows, matrix=matrix, choices=choices)
            found.append((m.digest(), m.exact, m.byte, m.prefix, m.same_bytes, m.gained, m.mended))
    return found


def test_class_defaults_are_transformers_own() -> None:
    """The special roles a class fills where the config names none are its ``__init__``'s defaults."""
    for name, defaults in _DIRECT_CLASSES.items():
        signature = inspect.signature(getattr(transformers, name).__init__)
        theirs = {key: p.default for key, p in signature.parameters.items()
                  if key.endswith("_token") and isinstance(p.default, str)}
        assert dict(defaults) == theirs, name


def test_tiny_tokenizers_read_directly_are_transformers(tmp_path: Path) -> None:
    """A byte-level BPE (the plain class, SmolLM2's layout) and a SentencePiece byte-fallback tokenizer of Gemma's
    class, whose config names only its bos (the class's defaults fill eos, unk, pad and mask: 0.1.5 matches specials
    by those roles): the same vocabularies and matches, both ways, as through transformers."""
    model = _folder(tmp_path / "model", _byte_level(["</s>", "<|endoftext|>"]),
                    {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "</s>",
                     "unk_token": "<|endoftext|>"})
    donor = _folder(tmp_path / "donor", _sentencepiece(GEMMA_SPECIALS),
                    {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>"})
    pairs = {}
    for directory in (model, donor):
        slow = _through_transformers(directory)
        _same(direct_vocabulary(directory), slow)
        _same(load_vocabulary(directory, what="MODEL"), slow)
        pairs[directory] = slow
    assert ("special", "eos_token") in pairs[donor].ids  # a default role, filled
    assert ("special", "eos_token") in pairs[model].ids  # </s>: eos before pad, the first role it fills
    rows = {d: max(v.ids.values()) + 1 for d, v in pairs.items()}
    direct = {d: direct_vocabulary(d) for d in (model, donor)}
    for a, b in ((model, donor), (donor, model)):
        theirs = direct[a]
        mine = direct[b]
        assert theirs is not None and mine is not None
        assert _digests(theirs, mine, rows[a], rows[b]) == _digests(pairs[a], pairs[b], rows[a], rows[b])


def test_tokenizers_transformers_rebuilds_or_adds_to_are_loaded_by_it(tmp_path: Path) -> None:
    """transformers is used where its load could differ: a class that rebuilds the pipeline (Llama's, GPT-2's),
    a special token the config or the class's defaults name that tokenizer.json lacks (it would be added), a config
    key that may change the tokens, extra special tokens, a special_tokens_map.json naming another token, no
    tokenizer.json; the vocabulary is still transformers' then."""
    sp = _sentencepiece(GEMMA_SPECIALS)
    cases = {
        "llama": (sp, {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<bos>"}),
        "gpt2": (_byte_level(["</s>"]), {"tokenizer_class": "GPT2TokenizerFast", "eos_token": "</s>"}),
        "lacks": (sp, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}),
        "default_lacks": (_sentencepiece(["<pad>", "<eos>", "<bos>", "<unk>"]), {"tokenizer_class": "GemmaTokenizer"}),
        "key": (sp, {"tokenizer_class": "GemmaTokenizer", "add_prefix_space": True}),
        "extra": (sp, {"tokenizer_class": "GemmaTokenizer", "extra_special_tokens": ["<mask>"]}),
    }
    for name, (tok, config) in cases.items():
        directory = _folder(tmp_path / name, tok, config)
        assert direct_vocabulary(directory) is None, name
        assert load_vocabulary(directory, what="MODEL").ids == _through_transformers(directory).ids, name
    mapped = _folder(tmp_path / "mapped", sp, {"tokenizer_class": "GemmaTokenizer"})
    (mapped / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<bos>"}))
    assert direct_vocabulary(mapped) is None
    (mapped / "tokenizer.json").unlink()
    assert direct_vocabulary(mapped) is None


@pytest.mark.slow
def test_the_real_pair_read_directly_is_transformers() -> None:
    """SmolLM2-135M's and Gemma-3-270M's tokenizers (the GGUF fixtures' rebuilt files: the plain class and
    ``GemmaTokenizer``): the same vocabularies as through transformers. So the same match both ways: a match of
    either matrix reads only what :func:`_same` compares (the ids in their order, the tokens' bytes, the spelling:
    the tokenizer itself for ``subword``'s pieces only), as the tiny pair's matches computed both ways show above.
    Computing the real pair's 16 matches as well took ~15 of this test's ~35 CPU s."""
    from check.test_byte_vocabs import _gemma3_gguf, _gguf_tokenizer
    from realmodel import smollm2_gguf

    gemma = _gguf_tokenizer(_gemma3_gguf(), "gemma3-270m")
    smol = _gguf_tokenizer(smollm2_gguf(), "smollm2-135m")
    for d in (gemma, smol):
        _same(direct_vocabulary(d), _through_transformers(d))
