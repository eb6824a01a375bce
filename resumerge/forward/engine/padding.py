"""Whether a decoder layer gives each sequence of a padded batch what it gives that sequence run alone: a family whose
attention, as transformers ships it, sees the padding is run one sequence at a time (a pass decides it from the
model's first layer alone, so a resumed pass decides the same: :func:`resumerge.forward.job.placement.batched_on`).
"""

from __future__ import annotations

from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.engine.tail import held_positions, sequence_row
from resumerge.machine.torch_import import torch

__all__ = ["PAD_TOLERANCE", "pads_alike"]

# How far a sequence's layer output in a padded batch may be from its output alone, relative to its largest value:
# float32's rounding of batched matrix products is 1e-6 of it at most; a top-k choice changed by the padding
# (DeepSeek-V3.2) moves it by 1e-2
PAD_TOLERANCE = 1e-4


def pads_alike(stream: ModelStream, layer: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
               entering: list[tuple[torch.Tensor, list[LayerCall]]], outputs: list[torch.Tensor]) -> bool:
    """Whether decoder ``layer`` (its weights loaded), whose ``outputs`` for the padded ``batches`` (ids and
    attention mask; ``entering``: what :meth:`~.stream.ModelStream.inputs` gave for them) are given, gives each
    sequence of a batch of several run alone what it gave at its real positions in the batch, to float32's rounding
    (:data:`PAD_TOLERANCE`). A family whose attention, as transformers ships it, sees the padding
    (DeepSeek-V3.2's indexer picks its top-k keys otherwise in a padded batch) does not, and is run one
    sequence at a time."""
    rows = [(b, r, int(mask[r].sum())) for b, (_, mask) in enumerate(batches) if len(mask) > 1
            for r in range(len(mask))]
    if not rows:
        return True
    for (b, r, n), (hidden, calls) in zip(rows, _alone(stream, batches, entering, rows)):
        if held_positions(hidden, (1, n)) != held_positions(entering[b][0], tuple(batches[b][1].shape)):
            return False  # the forward pads the positions itself, a batch otherwise (Reformer's chunks)
        own = stream.run(layer, hidden, calls[0])
        padded = sequence_row(outputs[b], batches[b][1].shape, r, n)
        if float((own - padded).abs().max()) > PAD_TOLERANCE * max(1.0, float(own.abs().max())):
            return False
    return True

def _alone(stream: ModelStream, batches: list[tuple[torch.Tensor, torch.Tensor]],
           entering: list[tuple[torch.Tensor, list[LayerCall]]], rows: list[tuple[int, int, int]]
           ) -> list[tuple[torch.Tensor, list[LayerCall]]]:
    """What :meth:`~.stream.ModelStream.inputs` gives for each sequence ``(batch, row, length)`` alone: its
    embeddings are its real positions' in the padded batch (right padding moves no position), handed to the forward
    as they are, so no weight is read again (a hub model's bytes are fetched once); where the forward cannot take
    them so (a family that needs the ids themselves) or changes them (Gemma 2 scales them), read again."""
    alone = [(batches[b][0][r:r + 1, :n], torch.ones(1, n, dtype=batches[b][1].dtype)) for b, r, n in rows]
    found = []
    try:
        for (ids, mask), (b, r, n) in zip(alone, rows):
            # made on the host, as the embeddings are; a copy: a forward may scale them in place (CTRL's did,
            # the batch's own entering states with them)
            embeds = sequence_row(entering[b][0], batches[b][1].shape, r, n).to("cpu", copy=True)
            hidden, calls = stream.capture(ids, mask, embeds)
            if not torch.equal(hidden, embeds):
                break
            found.append((hidden, calls))
        else:
            return stream.placed(found)
    except Exception:  # whatever the forward raises without ids: read them as :meth:`~.stream.ModelStream.inputs`
        pass
    return stream.inputs_of_rows(alone)
