"""The native modules: a decoder-only causal LM of the Llama or Gemma kind, its parameters on the meta device.

Names follow the checkpoints (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``model.norm``,
``lm_head``), so the forward engine reads and drops each module's weights exactly as it does transformers' modules.
The arithmetic is transformers' (sdpa attention), operation for operation, so the outputs are the same to the bit:
the RMS norm in float32 and its weight applied in the compute dtype; rotary cosines and sines in float32, cast; the
causal mask left to ``scaled_dot_product_attention``'s ``is_causal`` where no position is padded and no window
applies, else a boolean (batch, 1, query, key) mask; grouped key/value heads handed to the kernel as ``enable_gqa``
where no mask is given, else repeated. Gemma's ways (:class:`.config.NativeConfig`'s later fields) are its modules'
operations likewise: the norm's 1 + weight applied in float32, the embeddings' scale a buffer in the model's dtype,
and for Gemma 2 transformers' eager attention (scores soft-capped, an additive mask of the dtype's minimum, the
softmax in float32) rather than sdpa; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` are one matrix each, their
outputs sliced and chunked as transformers does. The classes subclass ``torch.nn.Module``, so they are made by
:func:`causal_lm` when it builds (as :mod:`resumerge.forward.engine.stream`'s stand-ins are): importing this module does
not import torch (tests/test_torch_import.py).
"""

from __future__ import annotations

from typing import Any

from resumerge.forward.engine.native.config import NativeConfig, Rope
from resumerge.forward.engine.native.rope import inverse_frequencies
from resumerge.machine.torch_import import torch

_GQA_WIDEST = 256  # the widest head the sdpa kernel takes grouped key/value heads for (transformers' rule)


class Output:
    """A forward's result under the names the engine reads (``last_hidden_state``, ``logits``)."""

    def __init__(self, last_hidden_state: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> None:
        self.last_hidden_state, self.logits = last_hidden_state, logits


def attention_mask_of(mask: torch.Tensor | None, length: int, window: int | None) -> torch.Tensor | None:
    """The mask one layer is called with, for a batch whose 2-D ``mask`` (1: a real token) is ``length`` long: None
    where the kernel's own causal mask is the whole of it (no padding, no window reached), else a boolean (batch,
    1, query, key) mask, True where a query position may attend to a key position."""
    padded = mask is not None and not bool(mask.all())
    if not padded and (window is None or length < window):
        return None
    return _allowed(mask, mask.shape[0] if mask is not None else 1, length, window)


def eager_mask_of(mask: torch.Tensor | None, batch: int, length: int, window: int | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """The additive (batch, 1, query, key) mask of eager attention: 0 where a query position may attend to a key
    position (as :func:`attention_mask_of`'s boolean mask says, always made), the least value of ``dtype``
    elsewhere."""
    allowed = _allowed(mask, batch, length, window)
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def _allowed(mask: torch.Tensor | None, batch: int, length: int, window: int | None) -> torch.Tensor:
    """The boolean (batch, 1, query, key) mask: True where a query position may attend to a key position (causal,
    within ``window``, a real token of the 2-D ``mask``)."""
    query = torch.arange(length)[None, None, :, None]
    key = torch.arange(length)[None, None, None, :]
    allowed = key <= query
    if window is not None:
        allowed = allowed & (key > query - window)
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    return allowed.expand(batch, -1, length, length)


def _capped(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap


def _meta(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


def _half_turned(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeated(heads: torch.Tensor, times: int) -> torch.Tensor:
    batch, kv, length, dim = heads.shape
    return heads[:, :, None, :, :].expand(batch, kv, times, length, dim).reshape(batch, kv * times, length, dim)


def causal_lm(config: NativeConfig, dtype: torch.dtype) -> Any:
    """The causal LM of ``config`` in ``dtype``, its parameters on the meta device and its rotary frequencies
    computed; it answers the engine as transformers' causal-LM classes do (``base_model``, ``base_model_prefix``,
    the input and output embeddings, a forward giving ``logits``)."""
    nn, functional = torch.nn, torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.weight = _meta(width, dtype=dtype)
            self.eps = config.rms_norm_eps

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            kept = hidden.dtype
            wide = hidden.to(torch.float32)
            wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
            if config.offset_norms:  # Gemma: 1 + weight, applied in float32
                return (wide * (1.0 + self.weight.float())).to(kept)
            return self.weight * wide.to(kept)

    class Rotary(nn.Module):
        """The cosines and sines of the positions (from the config: the files do not hold them)."""

        def __init__(self, rope: Rope) -> None:
            super().__init__()
            self.inv_freq: torch.Tensor
            self.register_buffer("inv_freq", inverse_frequencies(rope, config.head_dim), persistent=False)

        def forward(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            angles = positions[..., None].float() * self.inv_freq.to(device=like.device, dtype=torch.float)
            both = torch.cat((angles, angles), dim=-1)
            return both.cos().to(dtype=like.dtype), both.sin().to(dtype=like.dtype)

    class Linear(nn.Linear):
        """``torch.nn.Linear`` (its forward, and what the engine's passes look for) built without drawing initial
        values: on the meta device they would be thrown away, and drawing them was most of building the modules
        (1.0 of 1.1 s for 120 layers)."""

        def __init__(self, into: int, out: int, bias: bool) -> None:
            nn.Module.__init__(self)
            self.in_features, self.out_features = into, out
            self.weight = _meta(out, into, dtype=dtype)
            if bias:
                self.bias = _meta(out, dtype=dtype)
            else:
                self.register_parameter("bias", None)

    class Embedding(nn.Embedding):
        """``torch.nn.Embedding`` built without drawing initial values (see :class:`Linear`)."""

        def __init__(self) -> None:
            nn.Module.__init__(self)
            rows, pad = config.vocab_size, config.pad_token_id
            self.num_embeddings, self.embedding_dim = rows, config.hidden_size
            self.padding_idx = pad if pad is None or pad >= 0 else rows + pad
            self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
            self.weight = _meta(rows, config.hidden_size, dtype=dtype)
            self.embed_scale: torch.Tensor | None
            # Gemma's sqrt(hidden_size), made in the model's dtype as transformers makes it
            scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype) if config.embed_scale else None
            self.register_buffer("embed_scale", scale, persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            rows = super().forward(ids)
            return rows if self.embed_scale is None else rows * self.embed_scale.to(self.weight.dtype)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            width, heads, kv, dim = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                     config.head_dim)
            self.head_dim, self.groups = dim, heads // kv
            scalar = config.query_pre_attn_scalar
            self.scale = dim ** -0.5 if scalar is None else scalar ** -0.5
            self.widths = (heads * dim, kv * dim)
            if config.fused:  # Phi-3: queries, keys and values from one matrix, sliced as transformers slices it
                self.qkv_proj = Linear(width, (heads + 2 * kv) * dim, config.qkv_bias)
            else:
                self.q_proj = Linear(width, heads * dim, config.qkv_bias)
                self.k_proj = Linear(width, kv * dim, config.qkv_bias)
                self.v_proj = Linear(width, kv * dim, config.qkv_bias)
            self.o_proj = Linear(heads * dim, width, config.o_bias)
            self.q_norm = RMSNorm(dim) if config.qk_norm else None
            self.k_norm = RMSNorm(dim) if config.qk_norm else None

        def forward(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                    mask: torch.Tensor | None) -> torch.Tensor:
            shape = (*hidden.shape[:-1], -1, self.head_dim)
            q, k, v = self._projected(hidden, shape)
            if self.q_norm is not None and self.k_norm is not None and not config.offset_norms:
                q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: before the heads are transposed
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self.q_norm is not None and self.k_norm is not None and config.offset_norms:
                q, k = self.q_norm(q), self.k_norm(k)  # Gemma 3: after
            cos, sin = (t.unsqueeze(1) for t in cos_sin)
            q = (q * cos) + (_half_turned(q) * sin)
            k = (k * cos) + (_half_turned(k) * sin)
            if config.eager_attention:
                assert mask is not None
                attended = self._eager(q, k, v, mask)
                return self.o_proj(attended.reshape(*hidden.shape[:-1], -1).contiguous())  # type: ignore[no-any-return]
            length = q.shape[2]
            grouped: dict[str, Any] = {}
            if self.groups > 1:
                if mask is None and k.shape[-1] == v.shape[-1] <= _GQA_WIDEST:
                    grouped["enable_gqa"] = True
                elif length == 1:  # one query: each key/value head's group of query heads as its rows
                    q = q.reshape(q.shape[0], q.shape[1] // self.groups, self.groups, q.shape[-1])
                else:
                    k, v = _repeated(k, self.groups), _repeated(v, self.groups)
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scale,
                                                          is_causal=length > 1 and mask is None, **grouped)
            out = out.reshape(out.shape[0], -1, length, v.shape[-1]).transpose(1, 2).contiguous()
            return self.o_proj(out.reshape(*hidden.shape[:-1], -1).contiguous())  # type: ignore[no-any-return]

        def _projected(self, hidden: torch.Tensor, shape: tuple[int, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Queries, keys and values, (batch, length, heads, dim) each: from the fused matrix as views of its
            output (Phi-3), else one matrix each."""
            if config.fused:
                qkv = self.qkv_proj(hidden)
                q_end, kv_width = self.widths
                return (qkv[..., :q_end].view(shape), qkv[..., q_end:q_end + kv_width].view(shape),
                        qkv[..., q_end + kv_width:].view(shape))
            return self.q_proj(hidden).view(shape), self.k_proj(hidden).view(shape), self.v_proj(hidden).view(shape)

        def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            """transformers' eager attention: scores scaled (and soft-capped), the additive mask, the softmax in
            float32 cast back; (batch, query, heads, dim) out."""
            if self.groups > 1:
                k, v = _repeated(k, self.groups), _repeated(v, self.groups)
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
            if config.attn_logit_softcapping is not None:
                scores = _capped(scores, config.attn_logit_softcapping)
            weights = functional.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(weights, v).transpose(1, 2).contiguous()

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            width, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
            if config.fused:  # Phi-3: gate and up from one matrix, its output chunked in two
                self.gate_up_proj = Linear(width, 2 * inner, bias)
            else:
                self.gate_proj = Linear(width, inner, bias)
                self.up_proj = Linear(width, inner, bias)
            self.down_proj = Linear(inner, width, bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if config.fused:
                gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
                return self.down_proj(up * functional.silu(gate))  # type: ignore[no-any-return]
            gate = self.gate_proj(x)
            gate = functional.silu(gate) if config.hidden_act == "silu" else functional.gelu(gate, approximate="tanh")
            return self.down_proj(gate * self.up_proj(x))  # type: ignore[no-any-return]

    class DecoderLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Attention()
            self.mlp = MLP()
            self.input_layernorm = RMSNorm(config.hidden_size)
            self.post_attention_layernorm = RMSNorm(config.hidden_size)
            if config.sandwich_norms:
                self.pre_feedforward_layernorm = RMSNorm(config.hidden_size)
                self.post_feedforward_layernorm = RMSNorm(config.hidden_size)

        def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **_: Any) -> torch.Tensor:
            assert position_embeddings is not None
            if config.sandwich_norms:  # Gemma 2 and 3: each branch's output normed before it is added
                attended = self.self_attn(self.input_layernorm(hidden), position_embeddings, attention_mask)
                hidden = hidden + self.post_attention_layernorm(attended)
                fed = self.mlp(self.pre_feedforward_layernorm(hidden))
                return hidden + self.post_feedforward_layernorm(fed)  # type: ignore[no-any-return]
            hidden = hidden + self.self_attn(self.input_layernorm(hidden), position_embeddings, attention_mask)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))  # type: ignore[no-any-return]

    class DecoderModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = Embedding()
            self.layers = nn.ModuleList(DecoderLayer() for _ in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size)
            self.rotary_emb = Rotary(config.rope)
            self.local_rotary_emb = Rotary(config.local_rope) if config.local_rope is not None else None

        def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                    inputs_embeds: torch.Tensor | None = None, **_: Any) -> Output:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            batch, length = hidden.shape[:2]
            positions = torch.arange(length).unsqueeze(0)
            masks = {w: (eager_mask_of(attention_mask, batch, length, w, hidden.dtype) if config.eager_attention
                         else attention_mask_of(attention_mask, length, w)) for w in set(config.windows)}
            cos_sin = self.rotary_emb(hidden, positions)
            local = cos_sin if self.local_rotary_emb is None else self.local_rotary_emb(hidden, positions)
            for layer, window in zip(self.layers, config.windows):
                hidden = layer(hidden, attention_mask=masks[window],
                               position_embeddings=cos_sin if window is None else local)
            return Output(last_hidden_state=self.norm(hidden))

    class CausalLM(nn.Module):
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.model = DecoderModel()
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False)

        @property
        def base_model(self) -> torch.nn.Module:
            return self.model

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.model.embed_tokens

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Output:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            logits = self.lm_head(out.last_hidden_state)
            if config.final_logit_softcapping is not None:
                logits = _capped(logits, config.final_logit_softcapping)
            return Output(logits=logits)

    return CausalLM()
