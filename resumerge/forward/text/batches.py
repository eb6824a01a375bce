"""How a pass's token sequences go through the layers: in batches padded on the right to the longest of each, with
the attention mask, so that a layer is one call over many sequences rather than one per sequence (a causal layer's
output at a real position never sees the padding after it). The one owner of the batch rule and its sizes: the
pass (:mod:`resumerge.forward.job.layerpass`) enters its models with them, and a client's budget is found from the same
figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from resumerge.forward.engine.tail import held_positions
from resumerge.machine.torch_import import torch

# The padded tokens (sequences x longest) a batch may hold: a layer's activations (an MLP's widest, 1024 x its
# intermediate size in float32) stay about 100 MB on a 70B model.
BATCH_TOKENS = 1024

Batch = tuple["torch.Tensor", "torch.Tensor"]  # token ids and attention mask, both (batch, longest)
Hidden = list[list["torch.Tensor"]]  # per model, per batch: the hidden states (batch, longest, width)


def batches_of(sequences: Sequence[Sequence[int]], budget: int = BATCH_TOKENS) -> list[list[int]]:
    """The sequences' indices in batches: longest first, each batch as many as fit ``budget`` padded tokens (one
    at least), so that sequences of like length share a batch and little is padding."""
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * len(sequences[groups[-1][0]]) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def padded_positions(sequences: Sequence[Sequence[int]]) -> int:
    """The positions the pass's batches hold, padding included (what its hidden states and logits are sized by)."""
    return sum(len(g) * len(sequences[g[0]]) for g in batches_of(sequences))


def largest_batch(sequences: Sequence[Sequence[int]]) -> int:
    """The padded positions of the pass's largest batch (what one batch's logits are sized by)."""
    return max((len(g) * len(sequences[g[0]]) for g in batches_of(sequences)), default=0)


def padded(batch: Sequence[Sequence[int]]) -> Batch:
    """Token ids padded on the right with id 0 (never attended to: it comes after every real token) and the
    attention mask, both (batch, longest)."""
    longest = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, :len(s)] = torch.tensor(list(s))
        mask[row, :len(s)] = 1
    return ids, mask


def one_by_one(sequences: Sequence[Sequence[int]]) -> list[Batch]:
    """Each sequence a batch of its own, in order (a pass whose figures sum over every position, padding
    included, as ``measure``'s Grams do: the same sums whatever the other sequences' lengths)."""
    return [padded([s]) for s in sequences]


@dataclass(frozen=True)
class Entered:
    """The pass's batches as its models run them: ``groups`` (the sequences' indices in each batch), the padded
    ``batches`` and each model's hidden states entering its first decoder layer (``hidden``)."""

    groups: list[list[int]]
    batches: list[Batch]
    hidden: Hidden

    def real(self, before: int = 0) -> list[torch.Tensor]:
        """Each batch's real positions (its mask as booleans) among the positions its hidden states hold: the
        positions every figure is taken over; ``before``: how many of those come before the tokens' (CPM-Ant's
        prompt), the others the hidden states hold after them (Reformer's padding to its chunk length)."""
        found = []
        for (_, mask), hidden in zip(self.batches, self.hidden[0] if self.hidden else [None] * len(self.batches)):
            after = 0 if hidden is None else held_positions(hidden, tuple(mask.shape)) - before
            found.append(torch.nn.functional.pad(mask.bool(), (before if hidden is not None else 0, after),
                                                 value=False))
        return found

    def sequences(self, sequences: Sequence[Sequence[int]]) -> list[list[Sequence[int]]]:
        """The token sequences of each batch."""
        return [[sequences[i] for i in g] for g in self.groups]


def enter(sequences: Sequence[Sequence[int]], entering: Callable[[list[Batch]], Hidden],
          runs_batched: Callable[[], bool]) -> Entered:
    """The sequences in padded batches (:func:`batches_of`) entering the models (``entering``), or one sequence
    at a time where a batch of several is made and the family's first layer cannot run it (``runs_batched``:
    DeepSeek-V3's attention with a padding mask), or its forward cannot make a padded batch's layer calls (XLNet's
    causal mask, ``attn_type: uni``, adds the batch's padding mask in place to a mask of one sequence: transformers'
    own forward fails on it); decided from the model alone, so a resumed pass decides the same."""
    groups = batches_of(sequences)
    batches = [padded([sequences[i] for i in group]) for group in groups]
    several = any(len(g) > 1 for g in groups)
    hidden: Hidden | None = None
    try:
        hidden = entering(batches)
    except RuntimeError:  # (the forward's own failure on a padded batch; a sequence alone fails again if not that)
        if not several:
            raise
    if hidden is None or (several and not runs_batched()):
        groups = [[i] for g in groups for i in g]
        batches = [padded([sequences[i] for i in group]) for group in groups]
        hidden = entering(batches)
    return Entered(groups, batches, hidden)
