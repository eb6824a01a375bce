"""The forward engine's own modules for the common dense families (Llama, Mistral, Qwen2, Qwen3, Phi-3 and Phi-4,
Gemma, Gemma 2 and Gemma 3's text model), so that a pass over them starts without transformers.

A layer-streamed pass builds its model's modules on the meta device (:mod:`resumerge.forward.engine.stream`).
transformers' own modules cost a fresh process 2.5 s before the first layer runs — importing transformers, its config
classes and the family's modeling module — which every check, and again every resumed check, pays (bench/RESULTS.md,
issue 57). For the families whose decoder layer is the same few operations (RMSNorm, rotary attention through torch's
``scaled_dot_product_attention``, a gated SiLU MLP; Gemma's variants of them: norms scaling by 1 + weight, scaled
embeddings, a tanh GELU, norms after attention and the MLP, Gemma 2's eager soft-capped attention as transformers
runs it, Gemma 3's q/k norms and local and global rotary embeddings, soft-capped logits; Phi-3's fused
projections), :func:`native_modules`
builds modules with the same parameter names and the same arithmetic, operation for operation, so their outputs
equal transformers' to the bit (tests/check/test_native.py compares every layer, the logits and a whole check
against transformers' modules in float32 and bfloat16, with and without padding and sliding windows).
:mod:`.config` reads config.json with each family's defaults and decides; anything it does not know (another
family, a RoPE scaling it does not implement, another activation, bidirectional attention) goes to transformers'
modules, as before. :mod:`.rope` holds the rotary frequencies,
:mod:`.modules` the modules (imported only when built: they subclass ``torch.nn.Module``).

May import: errors, machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resumerge.forward.engine.native.config import NativeConfig, read_config
from resumerge.machine.torch_import import torch


def native_modules(doc: Mapping[str, Any], dtype: torch.dtype) -> tuple[NativeConfig, Any] | None:
    """The config and the causal-LM modules (weights on the meta device, buffers computed) of the model whose
    config.json is ``doc``, in ``dtype``; None where :func:`read_config` leaves it to transformers."""
    config = read_config(doc)
    if config is None:
        return None
    from resumerge.forward.engine.native.modules import causal_lm

    return config, causal_lm(config, dtype)


__all__ = ["NativeConfig", "native_modules", "read_config"]
