"""The answers of lm-eval's log-likelihood requests from a batch's last hidden states: each request's
continuation tokens' log-probabilities summed, and whether each is the greedy token, read at the positions that
predict them, over the head's vocabulary rows one block at a time.

So the head step holds one block's logits of the batch (a few MB), never a (positions × vocabulary) tensor: the
log-softmax's normaliser is a running log-sum-exp over the blocks (in float64), the greedy token a running first
maximum, and only the continuations' positions are kept of a block. A perplexity pass's documents of hundreds of
tokens on a 50k vocabulary no longer hold two 180 MB tensors (the 0.96 GB bench model's eval peaked there:
bench/RESULTS.md). The log-likelihoods equal lm-eval's ``hf`` model's to float32's rounding
(tests/evaluation/test_parity.py); a block's logits are the whole head's to the bit (the batch's whole hidden
states go through it, as in every pass's heads), so a GGUF and the folder it decodes to score alike."""

from __future__ import annotations

from collections.abc import Sequence

from resumerge.forward.compared.heads import head_blocks, head_step_bytes, logit_blocks
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.text.batches import largest_batch
from resumerge.machine.torch_import import torch

Answer = tuple[float, bool]


def tail_answers(stream: ModelStream, hidden: torch.Tensor, lengths: Sequence[int],
                 wanted: Sequence[Sequence[Sequence[int]]]) -> list[list[Answer]]:
    """Per row of ``hidden`` (rows, longest, width; row ``r`` a run of ``lengths[r]`` tokens), per continuation
    in ``wanted[r]`` (its tokens, scored at the run's last ``len`` positions): (its log-likelihood, whether every
    token is the greedy one)."""
    spans = [max(map(len, w), default=0) for w in wanted]  # each row's last positions any continuation reads
    if not any(spans):
        return [[] for _ in wanted]
    # the picked positions (row, position), the batch's whole hidden states run through the head (the same matmul
    # shapes as every pass's heads: a block's logits are then the whole head's to the bit, a GGUF's or a folder's)
    rows = torch.tensor([r for r, span in enumerate(spans) for _ in range(span)], dtype=torch.long)
    steps = torch.tensor([n - span + k for n, span in zip(lengths, spans) for k in range(span)], dtype=torch.long)
    first, at = [], 0
    for span in spans:
        first.append(at)
        at += span
    # each wanted token: its position among the picked ones and its id
    where = torch.tensor([first[r] + spans[r] - len(c) + k for r, w in enumerate(wanted) for c in w
                          for k in range(len(c))], dtype=torch.long)
    token = torch.tensor([t for w in wanted for c in w for t in c], dtype=torch.long)
    positions = len(rows)
    top = torch.full((positions,), -torch.inf, dtype=torch.float64)
    total = torch.zeros(positions, dtype=torch.float64)  # sum of exp(logit - top), rescaled as top rises
    best = torch.zeros(positions, dtype=torch.float32)
    greedy = torch.zeros(positions, dtype=torch.long)
    chosen = torch.zeros(len(token), dtype=torch.float32)
    for start, logits in logit_blocks(stream, hidden):
        block = logits[rows, steps]
        del logits
        stop = start + block.shape[-1]
        index = block.argmax(dim=-1)  # the first of equal maxima, as lm-eval's argmax takes it
        values = block.gather(-1, index[:, None])[:, 0]
        higher = values > best if start else torch.ones(positions, dtype=torch.bool)
        best = torch.where(higher, values, best)
        greedy = torch.where(higher, index + start, greedy)
        peak = torch.maximum(top, values.double())
        total = total * torch.exp(top - peak) + torch.exp(block.double() - peak[:, None]).sum(-1)
        top = peak
        inside = (token >= start) & (token < stop)
        chosen[inside] = block[where[inside], token[inside] - start]
    normaliser = top + torch.log(total)
    logprob = (chosen.double() - normaliser[where]).float()
    hit = greedy[where] == token
    answers: list[list[Answer]] = []
    at = 0
    for w in wanted:
        row = []
        for c in w:
            row.append((float(logprob[at:at + len(c)].sum()), bool(hit[at:at + len(c)].all())))
            at += len(c)
        answers.append(row)
    return answers


def tail_step_bytes(stream: ModelStream, runs: Sequence[Sequence[int]]) -> int:
    """What :func:`tail_answers` holds at most over the pass's ``runs``: the head's block (cast and mapped while
    read), a block's logits of the largest batch twice (computed, and its continuations' positions picked) and a
    few numbers per position; a head read whole holds the whole batch's logits, as check's heads do
    (:func:`~resumerge.forward.compared.heads.head_step_bytes`)."""
    positions = largest_batch(runs)
    blocks = head_blocks(stream)
    if blocks is None:
        return head_step_bytes(stream, positions, max(map(len, runs), default=0))
    rows = max(stop - start for start, stop in blocks)
    width = int(next(p for _, p in stream.model.get_output_embeddings().named_parameters()).shape[1])
    return 2 * rows * width * 4 + 2 * positions * rows * 4 + 32 * positions
