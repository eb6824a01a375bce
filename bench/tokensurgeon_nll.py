"""A transplant's NLL beside MODEL's on texts made of tokens both vocabularies hold (issue 85's real-weight check).

    python bench/tokensurgeon_nll.py MODEL RESULT [--texts N]

Each text is cut by MODEL's tokenizer; a text is kept when every one of its tokens is in RESULT's vocabulary too
(matched as tokensurgeon matches them: the word-start markers ``Ġ`` and ``▁`` are one), and RESULT reads the same
tokens by its own ids. Prints, per model, the NLL over its whole vocabulary and over the shared tokens only (each
model's log-probabilities renormalised over them), and the KL(MODEL ‖ RESULT) over the shared tokens: with every
shared row copied bit for bit the last two must be MODEL's (KL 0); the whole-vocabulary NLL is above MODEL's by the
probability DONOR's new rows take.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

WORDS = ("the of and to in is that it for was on with as by at from this be are have not or which one all but they "
         "we there can an their more had were when time about would who what so out up into has some them than "
         "other its only new two first may like then these over such also after most made many before must way "
         "well where much through years should between each because people same very just long world used")


def _key(token: str) -> str:
    return "\x00" + token[1:] if token[:1] in ("Ġ", "▁") else token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("result")
    parser.add_argument("--texts", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    tok_m, tok_r = AutoTokenizer.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.result)
    vocab_r = {_key(t): i for t, i in tok_r.get_vocab().items()}
    words = WORDS.split()
    gen = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(args.texts):
        picks = torch.randint(len(words), (24,), generator=gen).tolist()
        texts.append(" ".join(words[i] for i in picks))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    result = AutoModelForCausalLM.from_pretrained(args.result, dtype=torch.float32).eval()
    # A key two of MODEL's tokens share (``▁x`` and ``Ġx``) is one of RESULT's rows: left out, not counted twice.
    keys = Counter(_key(t) for t in tok_m.get_vocab())
    shared_m = sorted({i for t, i in tok_m.get_vocab().items() if _key(t) in vocab_r and keys[_key(t)] == 1
                       and i < model.config.vocab_size})
    shared_r = [vocab_r[_key(tok_m.convert_ids_to_tokens(i))] for i in shared_m]
    sums = {"model_nll": 0.0, "result_nll": 0.0, "model_shared_nll": 0.0, "result_shared_nll": 0.0, "kl_shared": 0.0}
    count, kept = 0, 0
    for text in texts:
        ids_m = tok_m(text, add_special_tokens=False)["input_ids"]
        tokens = tok_m.convert_ids_to_tokens(ids_m)
        if not all(_key(t) in vocab_r and keys[_key(t)] == 1 for t in tokens):
            continue
        kept += 1
        ids_r = [vocab_r[_key(t)] for t in tokens]
        with torch.no_grad():
            lm = torch.log_softmax(model(torch.tensor([ids_m])).logits[0, :-1].float(), -1)
            lr = torch.log_softmax(result(torch.tensor([ids_r])).logits[0, :-1].float(), -1)
        target_m, target_r = torch.tensor(ids_m[1:]), torch.tensor(ids_r[1:])
        sm, sr = lm[:, shared_m], lr[:, shared_r]
        sm, sr = sm - torch.logsumexp(sm, -1, keepdim=True), sr - torch.logsumexp(sr, -1, keepdim=True)
        pos = {i: j for j, i in enumerate(shared_m)}
        at = torch.tensor([pos[i] for i in ids_m[1:]])
        rows = torch.arange(len(at))
        sums["model_nll"] -= lm[rows, target_m].sum().item()
        sums["result_nll"] -= lr[rows, target_r].sum().item()
        sums["model_shared_nll"] -= sm[rows, at].sum().item()
        sums["result_shared_nll"] -= sr[rows, at].sum().item()
        sums["kl_shared"] += (sm.exp() * (sm - sr)).sum().item()
        count += len(at)
    print(json.dumps({"texts": kept, "tokens": count, "shared_tokens": len(shared_m),
                      **{k: v / max(1, count) for k, v in sums.items()}}, indent=2))


if __name__ == "__main__":
    main()
