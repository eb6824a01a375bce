"""What a check's steps hold, in bytes: the one place those figures are found, for the local check's budget
(:func:`~resumerge.analyses.check.job._fits`, which refuses a check that would not fit) and for the memory each Ray
actor of ``--executor ray`` declares (:func:`~resumerge.forward.placing.rayactor.actor_bytes`); and what a pass's
process holds beside them (:func:`settled_held`, ``measure``'s too), so that each start names one smallest budget."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resumerge.config.locations import cache_root
from resumerge.forward.compared.heads import head_step_bytes
from resumerge.forward.engine.layerlists import first_list
from resumerge.forward.engine.reader import step_sizes
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.text.batches import largest_batch, padded_positions
from resumerge.inputs.codecs import StoredFormats
from resumerge.inputs.safetensors_format import numel

if TYPE_CHECKING:
    from resumerge.merge.engine.unwritten import UnwrittenMerge

# Values per span the static pass reads a tensor in (4 MB in float32): what it holds of a plain tensor at once.
STATIC_SPAN = 1 << 20


@dataclass(frozen=True)
class StepBytes:
    """``states``: one model's hidden states over every padded position (float32, once: a step holds them in and
    out); per model (the merge first) ``layers``, its largest decoder layer (or its embeddings) in float32 as the
    forward pass reads it, ``decoder``, its largest decoder layer alone (what the folded static pass keeps of the
    base beside another model's, :mod:`resumerge.analyses.check.folded`; never the embeddings, which the static pass
    reads), ``heads``, its heads step streamed as a local check runs it, and ``held_heads``, its heads step with its own
    log-probabilities and the two it is compared with (the merge's, the base's) held whole, as a Ray actor runs
    it; ``static``: the static pass's largest span of a tensor of every model."""

    states: int
    layers: tuple[int, ...]
    decoder: tuple[int, ...]
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
    # Each step's weights as the pass holds them: a tensor the reader maps in place (a local float32 one) once,
    # not again for its read (the embeddings of a 1.2 GB model were counted twice: issue 72).
    steps = [step_sizes(s.formats, s.layers, value_bytes=4, embeddings=s.prefix(s.model.get_input_embeddings()),
                        stack=s.prefix(first_list(s.stack)), in_place=s.reader.maps,
                        steps=[s.prefix(m) for m in s.layers_list]) for s in streams]
    return StepBytes(
        states=padded_positions(tokens) * hidden * 4,
        layers=tuple(max(each.values()) for each in steps),
        decoder=tuple(max(list(each.values())[1:], default=0) for each in steps),
        heads=tuple(head_step_bytes(s, batch, longest) for s in streams),
        held_heads=tuple(head_step_bytes(s, batch, longest, held=3 * predicted) for s in streams),
        static=static_bytes([s.formats for s in streams]))


def settled_held(command: str, models: Sequence[str], tokens: Sequence[Sequence[int]]) -> int:
    """What this process of ``command`` (``check``, ``measure``) holds before its pass over ``models`` and ``tokens``,
    as every start of that work names it (:func:`~resumerge.machine.memory.baseline.settled_reading`, from this
    process's reading): the baseline its refusal and ``measure --plan`` name the smallest budget beside
    (:func:`~resumerge.machine.memory.budget.pass_budget`)."""
    from resumerge.machine.memory import SystemProbe
    from resumerge.machine.memory.baseline import settled_reading

    texts = hashlib.sha256(json.dumps([list(t) for t in tokens]).encode()).hexdigest()
    return settled_reading((command, *models, texts), SystemProbe().rss(), cache_root())


def static_bytes(streams_formats: Sequence[StoredFormats]) -> int:
    """The most the static pass holds at once: three models' spans of a tensor in float32 (two held, the third
    mapped while it is cast, at most as large again); a span is :data:`STATIC_SPAN` values of a plain tensor, the
    whole of a quantized one (decoded whole)."""
    def held(f: StoredFormats, name: str, shape: tuple[int, ...]) -> int:
        values = numel(f.codec(name).value_shape(shape))
        return values if name in f.claims else min(values, STATIC_SPAN)

    largest = max((held(f, n, tuple(found.entry.shape)) for f in streams_formats
                   for n, found in f.logical().items()), default=0)
    return 3 * largest * 4


def merged_steps(stream: ModelStream, merge: UnwrittenMerge, tokens: Sequence[Sequence[int]]) -> dict[str, int]:
    """What each layer step of a pass over the merge never written ``merge`` (read through ``stream``) over
    ``tokens`` holds at most, by its prefix (the embeddings', then each decoder layer's): its tensors' float32
    values, and one of its own tensors' merges at a time beside them, the largest (the embeddings' of the rows the
    texts use, where the method merges rows alone, as the pass then reads them). The tensor as read *is* its merge's
    output: counted once (:mod:`resumerge.analyses.evaluation.unwrittenneeds`, whose heads step comes after these;
    the importance pass runs no head)."""
    embeddings = stream.prefix(stream.model.get_input_embeddings())
    stack = stream.prefix(first_list(stream.stack))
    prefixes = [embeddings, *(f"{stack}{i}." for i in range(stream.layers))]
    values = step_sizes(stream.formats, stream.layers, value_bytes=4, embeddings=embeddings, stack=stack,
                        in_place=lambda name: True)  # the read copy is the merge's output: in its working set
    used = len({t for sequence in tokens for t in sequence})
    merges = dict.fromkeys(prefixes, 0)
    for name in merge.tensors:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        shape = tuple(merge.tensors[name].entry.shape)
        rows = used if prefix == embeddings and len(shape) == 2 and merge.merges_rows_alone(name) else None
        merges[prefix] = max(merges[prefix], merge.tensor_merge_bytes(name, rows) or 0)
        if rows is not None:  # the embeddings' step holds the rows the texts use, not the table
            values[prefix] = min(values[prefix], values[prefix] * used // max(1, shape[0]))
    return {p: values[p] + merges[p] for p in prefixes}
