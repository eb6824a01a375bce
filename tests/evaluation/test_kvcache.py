"""The layer-streamed generation's cache (:mod:`resumerge.analyses.evaluation.kvcache`): a sliding-window family's
windowed layers keep their window's last ``sliding_window - 1`` positions, as transformers' windowed cache does, and
the stand-in cache a step's calls are made against says so (its mask the window's); the held and the spilled store
(a ring) give a windowed layer's last positions, also after a killed step's write and a resume; a linear-attention
state is refused in one line. Configs and small tensors, no weights: instant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resumerge.analyses.evaluation.kvcache import HeldKV, KVShape, SpilledKV, shaped_cache
from resumerge.errors import ModelInputError

_SIZES = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8}


def test_a_sliding_window_familys_windowed_layers_keep_their_window() -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma3_text", **_SIZES, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    shape = KVShape.of(config, 3)
    assert shape == KVShape(3, 2, 8, (4, 0, 4))
    assert [shape.kept(layer, 10) for layer in range(3)] == [3, 10, 3]
    assert shape.cache_bytes(10) == (3 + 10 + 3) * 2 * 2 * 8 * 4
    cache = shaped_cache(config, 6)
    assert [cache.get_seq_length(layer) for layer in range(3)] == [6, 6, 6]
    # the windowed layers' masks span the 3 positions kept and the query, from position 3; the full one's all 7
    assert [cache.get_mask_sizes(1, layer) for layer in range(3)] == [(4, 3), (7, 0), (4, 3)]
    assert [cache.layers[layer].keys.shape[2] for layer in range(3)] == [3, 6, 3]


def _positions(start: int, count: int) -> torch.Tensor:
    """Keys (or values) of ``count`` positions from ``start``, one head of width 2: each position's number."""
    return torch.arange(start, start + count, dtype=torch.float32).repeat_interleave(2).view(1, 1, count, 2)


def test_held_and_spilled_stores_give_a_windowed_layer_its_window_after_a_killed_step_too(tmp_path: Path) -> None:
    shape = KVShape(2, 1, 2, (4, 0))  # layer 0 windowed (keeps 3), layer 1 full
    held, spilled = HeldKV(shape), SpilledKV(tmp_path, shape, [12])
    steps = []
    for store in (held, spilled):  # a prefill of 6 positions, then a position a step
        past = 0
        for added in (6, 1, 1, 1):
            for layer in (0, 1):
                before = store.past(layer, 0)
                had = 0 if before is None else before[0].shape[2]
                keys = torch.cat([before[0], _positions(past, added)], 2) if before is not None else \
                    _positions(past, added)
                assert had == (min(past, 3) if layer == 0 else past)
                store.keep(layer, 0, keys, keys, added)
            done = store.step_done()
            if store is held:
                steps.append(done)
            past += added
        assert store.past(0, 0)[0].flatten().tolist() == [6.0, 6.0, 7.0, 7.0, 8.0, 8.0]
        assert store.past(1, 0)[0].shape[2] == 9
    # a step killed after its windowed layer wrote position 9: resumed, the store gives positions 6 to 8 again
    grown = torch.cat([spilled.past(0, 0)[0], _positions(9, 1)], 2)
    spilled.keep(0, 0, grown, grown, 1)
    spilled.close(remove=False)
    again = SpilledKV(tmp_path, shape, [12])
    again.restore([{"added.0": torch.tensor(a)} for a in (6, 1, 1, 1)])
    assert again.past(0, 0)[0].flatten().tolist() == [6.0, 6.0, 7.0, 7.0, 8.0, 8.0]
    assert again.past(1, 0)[0].flatten().tolist() == [float(p) for p in range(9) for _ in range(2)]
    again.close(remove=True)
    rebuilt = HeldKV(shape)
    rebuilt.restore(steps)
    assert rebuilt.past(0, 0)[0].flatten().tolist() == [6.0, 6.0, 7.0, 7.0, 8.0, 8.0]
    assert rebuilt.past(1, 0)[0].shape[2] == 9


def test_a_linear_attention_state_is_refused_in_one_line() -> None:
    from transformers import AutoConfig

    kinds = ["linear_attention", "full_attention", "linear_attention"]
    config = AutoConfig.for_model("qwen3_next", **_SIZES, layer_types=kinds)
    with pytest.raises(ModelInputError, match="LinearAttentionLayer cache; a layer-streamed generation keeps keys"):
        KVShape.of(config, 3)
