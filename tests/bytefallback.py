"""The two tokenizer styles the tests of matching tokens by bytes train (check's shared vocabulary, the
transplant's match and its tokenizer read without transformers): a byte-level BPE (SmolLM2's pipeline) and a
SentencePiece-style BPE's model (Llama 2's and Gemma's layout: the specials, the 256 byte-fallback tokens
``<0xNN>``, then the pieces; ``▁`` for a space), to which each test gives its own pre-tokenizer or normalizer and
decoder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def byte_fallback_bpe(corpus: Sequence[str], specials: list[str], vocab_size: int) -> Any:
    """A ``tokenizers.Tokenizer`` whose BPE model was trained on ``corpus`` and laid out as SentencePiece's, with
    byte fallback; no pre-tokenizer, normalizer or decoder set."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                            show_progress=False))
    doc = json.loads(trained.to_str())["model"]
    pieces = [t for t, _ in sorted(doc["vocab"].items(), key=lambda item: item[1]) if t not in specials]
    order = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in doc["merges"]]
    return Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(order)}, merges=merges, byte_fallback=True,
                                unk_token="<unk>"))


def byte_level_bpe(corpus: Sequence[str], specials: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` (ByteLevel pre-tokenizer and decoder, all 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok
