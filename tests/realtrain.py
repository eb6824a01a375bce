"""Fine-tune a causal LM a few steps on one file of texts with transformers, in a child process of its own.

``python realtrain.py BASE OUT TEXTS STEPS LR BATCH SEED [MEASURED...]`` loads BASE (a transformers folder) in
float32, freezes its embedding (tied to the head in SmolLM2: the search merges decoder layers, and a few steps on
24 lines should not re-learn the vocabulary), then takes STEPS AdamW steps of learning rate LR over batches of
BATCH lines of TEXTS (one text per line, taken in a fixed order; every draw seeded by SEED, deterministic
algorithms on) and saves the model and BASE's tokenizer files to OUT with ``save_pretrained``, and ``nll.json``:
the mean NLL per token of BASE and of the tuned model on each MEASURED file (how far the steps moved each domain).
Only transformers and torch make these weights: resumerge's code takes no part in making the fixture it is tested
on.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any


def nll(model: Any, tokenizer: Any, texts: Path) -> float:
    """The mean NLL per predicted token of ``model`` on the lines of ``texts`` (all in one padded batch)."""
    import torch

    lines = [line for line in texts.read_text().splitlines() if line.strip()]
    encoded = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**encoded).logits[:, :-1].float()
    targets = encoded["input_ids"][:, 1:]
    kept = encoded["attention_mask"][:, 1:].bool()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return float(losses[kept].double().mean())


def train(base: Path, out: Path, texts: Path, steps: int, lr: float, batch: int, seed: int,
          measured: list[Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.get_input_embeddings().weight.requires_grad_(False)
    model.eval()
    before = {p.name: nll(model, tokenizer, p) for p in measured}
    lines = [line for line in texts.read_text().splitlines() if line.strip()]
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    model.train()  # SmolLM2 has no dropout: train mode changes nothing but transformers' own bookkeeping
    for step in range(steps):
        chosen = [lines[(step * batch + i) % len(lines)] for i in range(batch)]
        encoded = tokenizer(chosen, return_tensors="pt", padding=True)
        labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
        loss = model(**encoded, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    after = {p.name: nll(model, tokenizer, p) for p in measured}
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    (out / "nll.json").write_text(json.dumps({"base": before, "tuned": after}, indent=1))


if __name__ == "__main__":
    base, out, texts, steps, lr, batch, seed = sys.argv[1:8]
    train(Path(base), Path(out), Path(texts), int(steps), float(lr), int(batch), int(seed),
          [Path(p) for p in sys.argv[8:]])
