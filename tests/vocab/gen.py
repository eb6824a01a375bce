"""Generate small real BPE tokenizers (Hugging Face tokenizer directories) with chosen vocabularies.

``make_tokenizer_dir`` trains a byte-level BPE on the given words with the ``tokenizers`` package, so the result
is a tokenizer transformers and mergekit load like any hub tokenizer. ``seed`` shuffles the ids of the learned
vocabulary (merges are by text, so the tokenizer still works): two directories made from the same words with
different seeds hold the same tokens at different ids, which is what vocabulary alignment must undo.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<s>", "</s>")


def make_tokenizer_dir(
    path: Path,
    words: list[str],
    added: Sequence[str] = (),
    chat_template: str | None = None,
    seed: int = 0,
) -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``path``; return the vocab size.

    Ids: ``<s>`` 0 and ``</s>`` 1 (special added tokens), then the BPE vocabulary learned from ``words`` (its
    order shuffled by ``seed`` when ``seed != 0``), then ``added`` in order as added tokens (special when written
    ``<...>``, never normalised). The vocabulary size returned counts all of them.
    """
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=10_000, special_tokens=list(SPECIALS), show_progress=False)
    tokenizer.train_from_iterator([" ".join(words)], trainer)
    data: dict[str, Any] = json.loads(tokenizer.to_str())
    learned = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda item: item[1]) if t not in SPECIALS]
    if seed:
        random.Random(seed).shuffle(learned)
    vocab = {t: i for i, t in enumerate([*SPECIALS, *learned])}
    data["model"]["vocab"] = vocab
    entries = [_entry(i, t, special=True) for i, t in enumerate(SPECIALS)]
    for text in added:
        if text in vocab:
            raise ValueError(f"{text!r} is already in the learned vocabulary")
        vocab_id = len(vocab) + len(entries) - len(SPECIALS)
        entries.append(_entry(vocab_id, text, special=text.startswith("<") and text.endswith(">")))
    data["added_tokens"] = entries
    (path / "tokenizer.json").write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    config: dict[str, Any] = {
        "added_tokens_decoder": {
            str(e["id"]): {k: v for k, v in sorted(e.items()) if k != "id"} for e in entries
        },
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}, indent=2))
    return len(vocab) + len(entries) - len(SPECIALS)


def write_model_config(path: Path, vocab_size: int) -> None:
    """A Llama config.json declaring ``vocab_size`` embedding rows (what mergekit reads to strip tokenizers)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _entry(token_id: int, text: str, *, special: bool) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": text,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }
