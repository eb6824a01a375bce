"""The layer-streamed generation's cache shape (:mod:`resumerge.analyses.evaluation.kvcache`): a sliding-window
family's layers keep keys and values like a full layer's, and the stand-in cache a step's calls are made against
says every layer holds every past position (so the family's window mask spans them all); a linear-attention state is
refused in one line. Configs only, no weights: instant."""

from __future__ import annotations

import pytest

from resumerge.analyses.evaluation.kvcache import KVShape, shaped_cache
from resumerge.errors import ModelInputError

_SIZES = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8}


def test_a_sliding_window_family_streams_its_layers_holding_every_position() -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma3_text", **_SIZES, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert KVShape.of(config, 3) == KVShape(3, 2, 8)
    cache = shaped_cache(config, 6)
    assert [cache.get_seq_length(layer) for layer in range(3)] == [6, 6, 6]
    assert [cache.get_mask_sizes(1, layer) for layer in range(3)] == [(7, 0)] * 3  # the window's mask spans them


def test_a_linear_attention_state_is_refused_in_one_line() -> None:
    from transformers import AutoConfig

    kinds = ["linear_attention", "full_attention", "linear_attention"]
    config = AutoConfig.for_model("qwen3_next", **_SIZES, layer_types=kinds)
    with pytest.raises(ModelInputError, match="LinearAttentionLayer cache; a layer-streamed generation keeps keys"):
        KVShape.of(config, 3)
