"""Two tiny llama models of different tokenizers (WordLevel vocabularies trained here with ``tokenizers``), for the
transplant's tests: DONOR holds most of MODEL's words under other ids, MODEL's specials under other strings, words
that extend one of MODEL's (prefix matches), byte tokens ``<0xNN>`` of MODEL's letters (byte matches) and words of
its own."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from resumerge.cli.modelgen import ModelSpec, make_model

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def _words(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    found: list[str] = []
    while len(found) < count:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 6)))
        token = ("Ġ" + word) if rng.random() < 0.5 else word
        if token not in found:
            found.append(token)
    return found


def write_wordlevel(directory: Path, tokens: list[str], specials: dict[str, str]) -> None:
    """A WordLevel tokenizer of ``tokens`` (ids in order) whose ``specials`` (role -> token) are special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128, **specials}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


def make_pair(root: Path, *, model_tied: bool = False, donor_tied: bool = False, donor_dtype: torch.dtype =
              torch.float32, model_hidden: int = 48, donor_hidden: int = 64) -> tuple[Path, Path]:
    """(MODEL, DONOR) under ``root``."""
    words = _words(260, seed=1)
    letters = ["A", "B", "C", "D"]
    model_tokens = ["<unk>", "<s>", "</s>", *letters, *words]
    rng = random.Random(2)
    kept = [w for w in words if rng.random() < 0.8]
    extended = [w + "ba" for w in words[:20] if w + "ba" not in words]
    bytes_ = [f"<0x{ord(c):02X}>" for c in letters[:2]]
    own = [t for t in _words(60, seed=3) if t not in words]
    donor_tokens = [*kept, *extended, *bytes_, *own]
    rng.shuffle(donor_tokens)
    donor_tokens = ["<|unk|>", "<|begin|>", "<|endoftext|>", *donor_tokens]
    model = make_model(root / "model", ModelSpec(layers=1, hidden=model_hidden, intermediate=64,
                                                 vocab=len(model_tokens), tied=model_tied), seed=11)
    donor = make_model(root / "donor", ModelSpec(layers=1, hidden=donor_hidden, intermediate=64,
                                                 vocab=len(donor_tokens), tied=donor_tied, dtype=donor_dtype),
                       seed=12)
    write_wordlevel(model, model_tokens, {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    write_wordlevel(donor, donor_tokens, {"unk_token": "<|unk|>", "bos_token": "<|begin|>",
                                          "eos_token": "<|endoftext|>"})
    for folder, eos in ((model, 2), (donor, 2)):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["eos_token_id"], cfg["bos_token_id"] = eos, 1
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    _spread(donor)
    return model, donor


def _spread(folder: Path) -> None:
    """Give DONOR's embedding rows some structure (its random rows are all alike in norm): a few tokens far off."""
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name, t in tensors.items():
            if name.endswith("embed_tokens.weight"):
                t = t.clone()
                t[::7] *= 3
                tensors[name] = t
        save_file(tensors, str(path), metadata={"format": "pt"})
