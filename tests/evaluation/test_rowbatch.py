"""A token step's rows as one batch (:mod:`resumerge.analyses.evaluation.rowbatch`): each row's logits equal, bit
for bit, what transformers' own forward gives that request alone against its own cache (lm-eval's ``hf`` model's
greedy decode at its batch size of one), for requests of different lengths, left-padded into one cache; with and
without biases on the projections (Llama, Qwen2). Small generated models in this process: a second or two."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resumerge.analyses.evaluation.rowbatch import ROWS, Rows, padded, row_exact  # noqa: E402

LENGTHS = (5, 9, 7)


def _model(family: str) -> Any:
    torch.manual_seed(0)
    common = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    # Qwen2: biases on q, k and v
    kind = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    config = kind(**common)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_batch_of_rows_gives_each_row_its_own_logits_bit_for_bit(family: str) -> None:
    model = _model(family)
    generator = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 96, (1, n), generator=generator) for n in LENGTHS]
    newest = torch.randint(0, 96, (len(LENGTHS), 1), generator=generator)
    alone, caches = [], []
    # the cache's name in this transformers' forward and output (``cache`` since 5.x, ``past_key_values`` before)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        for r, ids in enumerate(contexts):
            cache = getattr(model(input_ids=ids, use_cache=True), name)
            caches.append(copy.deepcopy(cache))
            step = model(input_ids=newest[r:r + 1], use_cache=True, **{name: cache})
            alone.append(step.logits[0, -1])
        # the batch: every layer's pasts left-padded into one cache, each row at its own position, its own mask
        batch_cache = transformers.DynamicCache(config=model.config)
        starts: list[int] = []
        for index in range(model.config.num_hidden_layers):
            keys, values, starts = padded([(c.layers[index].keys, c.layers[index].values) for c in caches])
            batch_cache.update(keys, values, index)
        longest = max(LENGTHS)
        mask = torch.ones(len(LENGTHS), longest + 1, dtype=torch.long)
        for r, start in enumerate(starts):
            mask[r, :start] = 0
        rows = Rows("sdpa", (None,) * len(LENGTHS), tuple(starts))
        with row_exact(model):
            out = model(input_ids=newest, attention_mask=mask, position_ids=torch.tensor(LENGTHS).view(-1, 1),
                        use_cache=True, **{name: batch_cache, ROWS: rows})
    for r, own in enumerate(alone):
        assert torch.equal(out.logits[r, -1], own), (family, r, float((out.logits[r, -1] - own).abs().max()))
    assert model.config._attn_implementation == "sdpa"  # put back after the block
    assert all("forward" not in m.__dict__ for m in model.modules())
