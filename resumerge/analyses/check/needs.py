"""What a check's steps hold, in bytes: the one place those figures are found, for the local check's budget
(:func:`~resumerge.analyses.check.run._fits`, which refuses a check that would not fit) and for the memory each Ray
actor of ``--executor ray`` declares (:func:`~resumerge.analyses.check.onray.actor_bytes`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resumerge.analyses.check.heads import head_step_bytes
from resumerge.analyses.check.static import static_bytes
from resumerge.forward import pass_bytes
from resumerge.forward.batches import largest_batch, padded_positions
from resumerge.forward.stream import ModelStream


@dataclass(frozen=True)
class StepBytes:
    """``states``: one model's hidden states over every padded position (float32, once: a step holds them in and
    out); per model (the merge first) ``layers``, its largest decoder layer (or its embeddings) in float32 as the
    forward pass reads it, ``heads``, its heads step streamed as a local check runs it, and ``held_heads``, its
    heads step with its own log-probabilities and the two it is compared with (the merge's, the base's) held whole,
    as a Ray actor runs it; ``static``: the static pass's largest span of a tensor of every model."""

    states: int
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    held_heads: tuple[int, ...]
    static: int


def step_bytes(streams: Sequence[ModelStream], tokens: Sequence[Sequence[int]]) -> StepBytes:
    """The check's :class:`StepBytes` for the models ``streams`` over the token sequences ``tokens``; reads no
    weight (the stored tensors' headers and the modules' shapes only)."""
    config = streams[0].config.get_text_config()  # a multimodal model's language model's
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    batch, longest = largest_batch(tokens), max(map(len, tokens), default=0)
    predicted = sum(max(0, len(t) - 1) for t in tokens)
    return StepBytes(
        states=padded_positions(tokens) * hidden * 4,
        layers=tuple(pass_bytes(s.formats, s.layers, value_bytes=4, embeddings=s.prefix(s.model.get_input_embeddings()),
                                stack=s.prefix(s.layers_list)) for s in streams),
        heads=tuple(head_step_bytes(s, batch, longest) for s in streams),
        held_heads=tuple(head_step_bytes(s, batch, longest, held=3 * predicted) for s in streams),
        static=static_bytes([s.formats for s in streams]))
