"""What a pass over a merge never written holds at most, for the refusal before its first layer (issue 87: the
evaluation of a config asked for twice what it used).

A stored model's step holds each tensor's float32 value and the largest one as read beside it
(:func:`~resumerge.forward.engine.reader.step_sizes`); a merge never written is read as each tensor's merge, whose
working set (its inputs, its method's temporaries, its output) the merge's governor admits on its own
(:attr:`~resumerge.merge.engine.unwritten.UnwrittenMerge.merge_bytes`). The tensor "as read" *is* that merge's output:
counting it in the step and again in the merge counted the largest tensor twice, and adding the largest merge of the
whole model (the embeddings', the head's) to every step counted it beside steps that never merge it. So here:

- a layer step (the embeddings or one decoder layer) holds its tensors' values, and one of its own tensors' merges
  at a time beside them: the values, plus the largest merge of the step's tensors (the embeddings' of the rows the
  texts use, where the method merges rows alone, as the pass then reads them);
- the heads step merges the head first (nothing of the step held yet), then holds the head's value and the logits:
  the larger of the head's merge and the step without the head's read copy (the merge's output)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from resumerge.forward.compared.needs import merged_steps

if TYPE_CHECKING:
    from resumerge.forward.engine.stream import ModelStream
    from resumerge.merge.engine.unwritten import UnwrittenMerge


def merged_need(stream: ModelStream, merge: UnwrittenMerge, tokens: Sequence[Sequence[int]], heads: int) -> int:
    """The largest step of a pass over the merge never written ``merge`` (read through ``stream``) with its merges,
    over ``tokens``; ``heads``: the pass's heads step as a stored model's (its head read whole, so held twice while
    cast)."""
    layer = max(merged_steps(stream, merge, tokens).values(), default=0)
    embeddings = stream.prefix(stream.model.get_input_embeddings())
    head = stream.model.get_output_embeddings()
    weight = next((p for _, p in head.named_parameters()), None) if head is not None else None
    copy = weight.numel() * 4 if weight is not None else 0  # the head as read: its merge's output
    key = (embeddings if stream.tied_head() or head is None else stream.prefix(head)) + "weight"
    head_merge = merge.tensor_merge_bytes(key)
    return max(layer, merge.merge_bytes if head_merge is None else head_merge, heads - copy)
