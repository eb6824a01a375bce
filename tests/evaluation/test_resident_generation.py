"""Generation with the whole model held (:mod:`resumerge.analyses.evaluation.generate`) reads every part before the
decoder layers by the stream's own rule (``ModelStream._before_layers``), and the final norm and what the
causal-LM class runs around its head: before, it loaded the base model's children but the layer list, which for
OPT (its embeddings inside ``decoder`` beside the layers) read the whole decoder again, layers and all, and for the
BERT-likes left the head's prediction transform unread (a crash on the meta device). Tiny census models against
transformers' greedy ``generate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

CONTEXT = (5, 9, 77, 130, 41, 8)
NEW = 6


@pytest.mark.parametrize("family", ["opt", "bert", "dory"])  # (Dory loops its middle layers: each loaded once)
def test_resident_generation_is_transformers_greedy_generation(family: str, tmp_path: Path) -> None:
    import torch
    from census import make_census_model
    from transformers import AutoModelForCausalLM

    from resumerge.analyses.evaluation.generate import cached_stream, resident
    from resumerge.analyses.evaluation.genrequests import Wanted
    from resumerge.config.modelref import ModelRef
    from resumerge.forward.engine.reader import Weights
    from resumerge.inputs.model import open_model

    directory = make_census_model(tmp_path / family, family, 1)
    if family == "bert":  # a decoder (causal attention): a bidirectional BERT's earlier keys change with each token
        doc = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**doc, "is_decoder": True}))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        done = reference.generate(torch.tensor([CONTEXT]), attention_mask=torch.ones(1, len(CONTEXT), dtype=torch.long),
                                  do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
    want = done[0, len(CONTEXT):].tolist()
    opened = open_model(ModelRef(str(directory)), directory=directory)
    read: list[str] = []
    with cached_stream(Weights.of(opened.directory, opened.tensors), opened.config, torch.float32) as stream:
        reader_read = stream.reader.read

        def counted(key: str) -> torch.Tensor:
            read.append(key)
            return reader_read(key)

        stream.reader.read = counted  # type: ignore[method-assign]
        with torch.no_grad(), resident(stream) as continued:
            tokens = continued(Wanted(CONTEXT, (), NEW, None, eot=-1), None)
            got = [next(tokens) for _ in range(NEW)]
    assert got == want
    layers = [key for key in read if ".layers." in key or ".layer." in key]
    # each layer's weights read once (Dory's checkpoint names its layers otherwise than its modules: transformers'
    # conversion reads them all for each part it loads, a layer looped or not)
    assert layers and (len(layers) == len(set(layers)) or family == "dory")
