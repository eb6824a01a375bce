"""llama.cpp's own forward of a GGUF file, position by position, through the library the tests' oracle loads
(``tests/llamacpp_oracle.py``, llama-cpp-py-sync): what ``bench_gguf_target.py`` measures the KL of two files with,
both run by llama.cpp (an F32 file of the float merge the reference).

Each text is decoded alone (its own KV cache, every position's logits asked), on ``n_threads`` threads, with an F32
KV cache and no flash attention: llama.cpp's attention in float32."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from llamacpp_oracle import declare_forward, needs_library


@contextmanager
def llama_model(model: Path, n_threads: int = 1) -> Iterator[object]:
    """A function of a text's token ids that returns its logits (float32, tokens × vocabulary) as llama.cpp
    computes them with the GGUF ``model`` loaded once."""
    _, llama = needs_library()
    declare_forward(llama)
    params = llama.llama_model_default_params()
    params.n_gpu_layers = 0
    loaded = llama.llama_model_load_from_file(str(model).encode(), params)
    if not loaded:
        raise RuntimeError(f"llama.cpp could not load {model}")
    vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(loaded))
    widest = 2048
    context = llama.llama_context_default_params()
    context.n_ctx = context.n_batch = context.n_ubatch = widest
    context.n_seq_max = 1
    context.n_threads = context.n_threads_batch = n_threads
    context.type_k = context.type_v = 0
    context.flash_attn_type = 0
    context.no_perf = True
    ctx = llama.llama_init_from_model(loaded, context)
    batch = llama.llama_batch_init(widest, 0, 1)

    def logits(ids: Sequence[int]) -> np.ndarray:
        assert 0 < len(ids) <= widest
        llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(ids)
        assert llama.llama_decode(ctx, batch) == 0
        found = np.ctypeslib.as_array(llama.llama_get_logits(ctx), shape=(len(ids) * vocab,))
        return found.reshape(len(ids), vocab).copy()

    try:
        assert ctx, "llama_init_from_model failed"
        yield logits
    finally:
        llama.llama_batch_free(batch)
        if ctx:
            llama.llama_free(ctx)
        llama.llama_model_free(loaded)


def kl_by_llama(reference: Path, model: Path, texts: Sequence[Sequence[int]], n_threads: int = 1) -> dict[str, float]:
    """KL(``reference`` ‖ ``model``) per position, averaged over every position of ``texts``, and the share of
    positions whose most likely next token is the same: both files run by llama.cpp."""
    total, same, positions = 0.0, 0, 0
    with llama_model(reference, n_threads) as first, llama_model(model, n_threads) as second:
        for ids in texts:
            p, q = _log_softmax(first(ids)), _log_softmax(second(ids))
            total += float((np.exp(p) * (p - q)).sum())
            same += int((p.argmax(-1) == q.argmax(-1)).sum())
            positions += len(ids)
    return {"kl": total / positions, "top1": same / positions}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    values = logits.astype(np.float64)
    values -= values.max(axis=-1, keepdims=True)
    return values - np.log(np.exp(values).sum(axis=-1, keepdims=True))
