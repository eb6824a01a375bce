"""The end of a check's forward pass: each model's head over its last hidden states, and the figures from the
log-probabilities (NLL; the merge's KL from each other model, its 95th percentile, top-1 agreement; KL of each
parent from the base).

Streamed, so that what it holds does not grow with the texts nor with the vocabulary: one model at a time, one
batch at a time; of the head, a block of its vocabulary rows at a time where the checkpoint lets a block be read
alone (a plain tensor in a local safetensors file: the embedding of a tied head is read 4 MB at a time, never
whole); of the log-probabilities, one sequence's at a time, the merge's and the base's, which every other
model's are compared with, kept in a scratch folder on disk (float32, as computed) rather than in memory. Every
figure is the same as from all log-probabilities held at once: the logits of a block of rows are the same
numbers as those of the whole head (see :data:`HEAD_BLOCK_BYTES`), and every sum runs over the same positions in
the same order.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from resumerge.errors import ModelInputError
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.text.vocabs import SharedVocab
from resumerge.inputs.safetensors_format import numel
from resumerge.machine.torch_import import torch

# The head's rows read at a time: about this many bytes in float32, in whole multiples of _ROWS rows: the matmul
# kernels work across rows in groups of 16 (AVX-512's float32 lanes), and a block of a multiple of them gives the
# same logits, to the bit, as the whole head (blocks of 5 rows did not: tests/check/test_streamed.py).
HEAD_BLOCK_BYTES = 4 << 20
_ROWS = 16
SCRATCH = "heads"
Batch = Sequence[Sequence[int]]


@dataclass(frozen=True)
class HeadTotals:
    """Per model (the merge first): ``nll``; ``kl``, ``kl_p95``, ``top1`` of the merge from it (None for the
    merge); ``base_kl`` KL(base ‖ it) for each parent where there is a base; ``tokens`` predicted."""

    nll: list[float]
    kl: list[float | None]
    kl_p95: list[float | None]
    top1: list[float | None]
    base_kl: list[float | None]
    tokens: int


def head_figures(streams: Sequence[ModelStream], hidden: list[list[torch.Tensor]], batches: Sequence[Batch],
                 base: int | None, workdir: Path, vocab: SharedVocab | None = None) -> HeadTotals:
    """The figures of every model's log-probabilities at each real position that has a next token (``hidden``:
    each model's last hidden states per batch; ``batches``: the token sequences of each batch). Where the models'
    vocabularies differ (``vocab``), each NLL is over its own and the comparisons over the shared tokens
    (:mod:`resumerge.forward.text.vocabs`)."""
    n = len(streams)
    tokens = sum(len(s) - 1 for batch in batches for s in batch)
    scratch = workdir / SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)  # a killed check's: computed again
    scratch.mkdir(parents=True)
    nll: list[float] = [0.0] * n
    kl: list[float | None] = [None] * n
    p95: list[float | None] = [None] * n
    top1: list[float | None] = [None] * n
    base_kl: list[float | None] = [None] * n
    try:
        total = 0.0
        targets = targets_of(batches, vocab, 0)
        for b, rows in enumerate(logprobs(streams[0], hidden[0], batches)):
            for row, found in enumerate(rows):
                total = nll_sum(found, targets[b][row], total)
                if n > 1:  # compared with every other model's
                    _keep(scratch, 0, b, row, shared(vocab, 0, found))
        nll[0] = total / tokens
        for m in range(1, n):
            total, agree = 0.0, 0
            per_position: list[torch.Tensor] = []
            from_base: list[torch.Tensor] = []
            targets = targets_of(batches, vocab, m)
            for b, rows in enumerate(logprobs(streams[m], hidden[m], batches)):
                for row, found in enumerate(rows):
                    total = nll_sum(found, targets[b][row], total)
                    theirs = shared(vocab, m, found)
                    del found
                    merged = _kept(scratch, 0, b, row)
                    per_position.append(kl_at(theirs, merged))
                    agree += int((theirs.argmax(-1) == merged.argmax(-1)).sum())
                    del merged
                    if m == base and m < n - 1:  # the parents after it are compared with it
                        _keep(scratch, m, b, row, theirs)
                    elif base is not None and base < m:
                        from_base.append(kl_at(_kept(scratch, base, b, row), theirs))
                    del theirs
            nll[m] = total / tokens
            kl[m], p95[m] = kl_summary(torch.cat(per_position))
            top1[m] = float(agree / tokens)
            if from_base:
                base_kl[m] = kl_summary(torch.cat(from_base))[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return HeadTotals(nll=nll, kl=kl, kl_p95=p95, top1=top1, base_kl=base_kl, tokens=tokens)


def kl_summary(values: torch.Tensor) -> tuple[float, float]:
    """The mean and the 95th percentile of per-position KL ``values``, in float64. KL is never negative: a
    position's rounding below 0 (-2.4e-09 where two models are one, issue 97) counts as 0."""
    found = values.double().clamp(min=0.0)
    return float(found.mean()), float(torch.quantile(found, 0.95))


def logprobs(stream: ModelStream, states: Sequence[torch.Tensor], batches: Sequence[Batch]
             ) -> Iterator[Iterator[torch.Tensor]]:
    """Per batch, the model's log-probabilities at the real positions of each sequence that have a next token,
    a (length − 1, vocabulary) tensor per sequence, each made as it is taken (the batch's logits held, one
    sequence's log-probabilities): the head read a block of rows at a time where it can be
    (:func:`head_blocks`), else whole once."""
    blocks = head_blocks(stream)
    if blocks is None:
        with stream.head() as head:
            for h, batch in zip(states, batches):
                yield _rows(head(h).float(), batch)
        return
    vocab = blocks[-1][1]
    for h, batch in zip(states, batches):
        logits: torch.Tensor | None = None
        for start, found in logit_blocks(stream, h):
            if logits is None:  # the positions' shape the head gives (DeepSeek-V4's hyper-connection streams: one)
                logits = torch.empty(*found.shape[:-1], vocab)
            logits[..., start:start + found.shape[-1]] = found
        assert logits is not None  # a head has a block at least
        yield _rows(logits, batch)
        del logits


def logit_blocks(stream: ModelStream, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """The logits of the last hidden states ``hidden`` (..., width), float32, a block of vocabulary rows at a
    time: (the block's first row, its logits), the head read a block at a time where it can be
    (:func:`head_blocks`), else whole once (one block of every row)."""
    blocks = head_blocks(stream)
    if blocks is None:
        with stream.head() as head:
            yield 0, head(hidden).float()
        return
    for start, stop in blocks:
        with stream.head(_block(stream, start, stop)) as head:
            yield start, head(hidden).float()


def head_blocks(stream: ModelStream) -> list[tuple[int, int]] | None:
    """The blocks of vocabulary rows the head is read in (about :data:`HEAD_BLOCK_BYTES` each, a multiple of 16
    rows but the last), or None where it is read whole: a head that is not a plain linear layer, or whose
    weights cannot be read a block alone (quantized, from the hub, under another name)."""
    head = stream.model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return None
    keys = _head_keys(stream, head)
    if not all(stream.reader.spannable(key) for key in keys.values()):
        return None
    shape = tuple(stream.formats.stored[keys["weight"]].entry.shape)
    if len(shape) != 2:
        return None
    rows = max(_ROWS, HEAD_BLOCK_BYTES // (shape[1] * 4) // _ROWS * _ROWS)
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]


def head_step_bytes(stream: ModelStream, positions: int, longest: int, held: int = 0) -> int:
    """What the heads hold at most for batches of up to ``positions`` padded positions and sequences of up to
    ``longest`` tokens: the head's block cast and mapped while read (or the whole head:
    :func:`_whole_head_bytes`), one batch's logits, and five (sequence, vocabulary) float32 tensors (its
    log-probabilities, the merge's and the base's read back, the KL's two temporaries); and ``held`` more positions'
    log-probabilities (a Ray actor holds its own, the merge's and the base's whole:
    :mod:`resumerge.forward.placing.rayactor`)."""
    head = stream.model.get_output_embeddings()
    weight = next((p for _, p in head.named_parameters()), None) if head is not None else None
    if weight is None or weight.dim() != 2:
        return 0
    vocab, width = int(weight.shape[0]), int(weight.shape[1])
    blocks = head_blocks(stream)
    read = 2 * max(b - a for a, b in blocks) * width * 4 if blocks is not None else _whole_head_bytes(stream, head)
    return read + (positions + 5 * longest + held) * vocab * 4


def _whole_head_bytes(stream: ModelStream, head: torch.nn.Module) -> int:
    """What the head read whole holds: its values in float32 beside what is read of it (a quantized one's parts, a
    copied one's bytes), as :func:`~resumerge.forward.engine.reader.step_sizes` counts a tensor read; where its stored
    form is not known, twice its float32 values. (Twice float32 always made a Q4_1 SmolLM2's head 95 MB more than it
    holds: eval's estimate 1.3-1.4x its run's peak.)"""
    values = read = 0
    for name, key in _head_keys(stream, head).items():
        found = stream.formats.stored.get(key)
        size = numel(tuple(getattr(head, name).shape))
        if found is None:
            return 2 * 4 * sum(numel(tuple(p.shape)) for _, p in head.named_parameters())
        values += size
        read += found.entry.nbytes + sum(c.entry.nbytes for _, c in stream.formats.companions(key))
    return values * 4 + read


def _head_keys(stream: ModelStream, head: torch.nn.Module) -> dict[str, str]:
    """The head's parameters' checkpoint names (the input embeddings' for a tied head), as :meth:`load` reads
    them."""
    owner = stream.model.get_input_embeddings() if stream.tied_head() else head
    prefix = stream.prefix(owner)
    return {name: prefix + name for name, _ in head.named_parameters()}


def _block(stream: ModelStream, start: int, stop: int) -> dict[str, torch.Tensor]:
    """The head's parameters' rows ``start`` to ``stop`` (read from the checkpoint, nothing else)."""
    head = stream.model.get_output_embeddings()
    found = {}
    for name, key in _head_keys(stream, head).items():
        shape = tuple(stream.formats.stored[key].entry.shape)
        per_row = numel(shape[1:])
        found[name] = stream.reader.read_span(key, start * per_row, stop * per_row).view(stop - start, *shape[1:])
    return found


def _rows(logits: torch.Tensor, batch: Batch) -> Iterator[torch.Tensor]:
    for row, s in enumerate(batch):
        yield torch.log_softmax(logits[row, :len(s) - 1], dim=-1)


def _keep(scratch: Path, model: int, batch: int, row: int, found: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({"lp": found.contiguous()}, str(scratch / f"{model}-{batch}-{row}.safetensors"))


def _kept(scratch: Path, model: int, batch: int, row: int) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(scratch / f"{model}-{batch}-{row}.safetensors"))["lp"]


def targets_of(batches: Sequence[Batch], vocab: SharedVocab | None, m: int) -> list[list[torch.Tensor]]:
    """Each sequence's next tokens (per batch) as model ``m``'s ids (the texts' tokenizer's where ``vocab`` is
    None: the vocabularies are one)."""
    found = [[torch.tensor(list(s[1:])) for s in batch] for batch in batches]
    return found if vocab is None else [[vocab.own(m, t) for t in batch] for batch in found]


def shared(vocab: SharedVocab | None, m: int, found: torch.Tensor) -> torch.Tensor:
    """Model ``m``'s log-probabilities as the comparisons take them: over the shared tokens, renormalised, where
    the vocabularies differ (:meth:`SharedVocab.restrict`); as they are where they are one."""
    return found if vocab is None else vocab.restrict(m, found)


def kl_at(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ other) at each position, from log-probabilities."""
    return (reference.exp() * (reference - other)).sum(dim=-1)


def nll_sum(found: torch.Tensor, target: torch.Tensor, total: float) -> float:
    """``total`` plus the negative log-likelihood of one sequence's next tokens; :class:`ModelInputError` for a token
    past the head's rows (Inkling 2's head holds its unpadded vocabulary's, fewer than its embedding's)."""
    rows = found.shape[-1]
    if len(target) and int(target.max()) >= rows:
        raise ModelInputError(f"a text holds token {int(target.max())}, past the {rows:,} rows of the model's head "
                              f"(it scores tokens 0 to {rows - 1:,})")
    return total + float(-found.gather(-1, target.unsqueeze(-1)).double().sum())
