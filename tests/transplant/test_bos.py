"""The output's tokenizer adds what MODEL's adds (issue 97): a MODEL whose tokenizer puts its BOS before every text,
given a DONOR whose tokenizer adds none, gives an output whose tokenizer adds DONOR's token of MODEL's BOS row, so
it generates what MODEL generates; a GGUF output says so in its keys, and is named after MODEL, not "resumerge
merge"."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from ggufmodels import Q, hf_tensors, to_gguf, write_gguf

from resumerge import api
from transplant.pairs import make_pair


def add_bos(folder: Path, bos: str) -> None:
    """``folder``'s tokenizer made to put ``bos`` before every text (a TemplateProcessing post-processor, as
    Gemma's and Llama's tokenizer.json have)."""
    path = folder / "tokenizer.json"
    doc = json.loads(path.read_text())
    bos_id = doc["model"]["vocab"][bos]
    doc["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    path.write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model, donor = make_pair(tmp_path_factory.mktemp("bos"), model_hidden=256)
    add_bos(model, "<s>")
    return model, donor


def test_the_output_tokenizer_adds_models_bos_and_generates_as_model(pair: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    import transformers

    model, donor = pair
    out = tmp_path / "out"
    api.tokensurgeon(str(model), str(donor), out, surgery=api.Surgery(k=8),
                     settings=api.Settings(state_dir=tmp_path / "state"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(donor))
    mine = transformers.AutoTokenizer.from_pretrained(str(model))
    made = transformers.AutoTokenizer.from_pretrained(str(out))
    begin = theirs.convert_tokens_to_ids("<|begin|>")
    assert theirs("A B")["input_ids"][0] != begin  # DONOR's adds none
    assert mine("A B")["input_ids"][0] == mine.convert_tokens_to_ids("<s>")
    assert made("A B")["input_ids"][0] == begin  # DONOR's token of MODEL's BOS row, as MODEL's tokenizer adds it
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == begin
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<|begin|>"
    from tokenizers import Tokenizer  # the tokenizers library reads tokenizer.json alone: it adds it too

    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("A B").ids[0] == begin
    card = (out / "README.md").read_text()
    assert "the output's tokenizer adds '<|begin|>' (id 1) before a text" in card, card
    # Greedy generation over the tokens both vocabularies write alike (the others suppressed on both sides): the
    # output's is MODEL's, each reading the prompt as its own tokenizer cuts it.
    vocab_m, vocab_o = mine.get_vocab(), made.get_vocab()
    both = {t for t in vocab_m if t in vocab_o and not t.startswith("<")}
    words = sorted(t for t in both if not t.startswith("Ġ") and len(t) > 1)
    prompts = [" ".join(words[i::17][:6]) for i in range(3)]
    generated = []
    for folder, tokenizer, vocab in ((model, mine, vocab_m), (out, made, vocab_o)):
        lm = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        lm.generation_config.pad_token_id = None
        suppressed = [i for t, i in vocab.items() if t not in both]
        texts = []
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                new = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                  suppress_tokens=suppressed)[0, ids.shape[1]:]
            texts.append(tokenizer.convert_ids_to_tokens(new.tolist()))
        generated.append(texts)
    assert generated[0] == generated[1]


def test_a_gguf_output_adds_models_bos_and_is_named_after_model(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """A GGUF DONOR whose file adds no BOS: the output's file says it adds one, DONOR's BOS (the token of MODEL's
    BOS's role); its name is MODEL's with DONOR's tokenizer; its card says no transformers."""
    model, _ = pair
    path = tmp_path / "donor.gguf"
    write_gguf(path, "llama", to_gguf("llama", hf_tensors("llama")), Q.F32)
    out = tmp_path / "out"
    api.tokensurgeon(str(model), str(path), out, surgery=api.Surgery(approximation_method="mean"),
                     settings=api.Settings(output=api.Output(out_type="gguf", gguf_type="q8_0"),
                                           state_dir=tmp_path / "s"))
    fields = gguf.GGUFReader(out / "model.gguf").fields
    parent = gguf.GGUFReader(path).fields

    def value(table: dict[str, gguf.ReaderField], key: str) -> object:
        return table[key].contents()

    assert value(parent, "tokenizer.ggml.add_bos_token") is False
    assert value(fields, "tokenizer.ggml.add_bos_token") is True
    assert value(fields, "tokenizer.ggml.bos_token_id") == value(parent, "tokenizer.ggml.bos_token_id")
    assert value(fields, "general.name") == "model with donor's tokenizer"
    card = (out / "README.md").read_text()
    front = card.split("---", 2)[1]
    assert "library_name" not in front and "- gguf" in front


def test_a_bos_donors_tokenizer_adds_is_dropped_where_models_adds_none(pair: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """The other way round: MODEL (the BOS-less one) given the tokenizer of one that adds a BOS. MODEL never read a
    BOS, so the output's tokenizer adds none, and its config and card say so."""
    import transformers

    with_bos, without = pair[0], pair[1]
    out = tmp_path / "out"
    api.tokensurgeon(str(without), str(with_bos), out, surgery=api.Surgery(k=8),
                     settings=api.Settings(state_dir=tmp_path / "state"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(with_bos))
    made = transformers.AutoTokenizer.from_pretrained(str(out))
    assert theirs("A B")["input_ids"] == [theirs.convert_tokens_to_ids(t) for t in ("<s>", "A", "B")]
    assert made("A B")["input_ids"] == [made.convert_tokens_to_ids(t) for t in ("A", "B")]
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is False
    assert "the output's tokenizer adds nothing" in (out / "README.md").read_text()
