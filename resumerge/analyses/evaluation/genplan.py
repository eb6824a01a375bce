"""A layer-streamed generation judged before any weight is read (:class:`GenPlan`): what each step holds (a decoder
layer in float32 with one request's attention scores and every request's past at it, the head with every request's
logits), the hidden states of the first token step (every context whole), the KV cache (every request's context and its
new tokens at every layer, a sliding-window layer's only as many as its window sees: :mod:`.kvcache`), and whether
that cache is held in RAM beside the largest step or spilled to the pass's folder; then the estimate said before it
starts, as ``plan`` says a merge's: the token steps, the bytes each reads (every decoder layer, the final norm and the
head, the new tokens' embedding rows) and, where the weights' disk was probed, the floor of its time (those bytes at
the disk's cold read speed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from resumerge.analyses.evaluation.genrequests import Wanted
from resumerge.analyses.evaluation.kvcache import KVShape
from resumerge.errors import UsageError
from resumerge.forward.compared.heads import head_step_bytes
from resumerge.forward.compared.needs import step_bytes
from resumerge.forward.engine.stream import ModelStream
from resumerge.machine.memory import SystemProbe, budget_fitting
from resumerge.machine.memory.sizes import format_size

_FLOAT = 4
_ROWS_HELD = 64 << 20  # what a step's batch of requests' pasts may hold at least, beside its layer


@dataclass(frozen=True)
class GenPlan:
    """The generation's figures: ``budget`` in force, what its steps reserve (``steps``: ``layer``, ``heads``),
    ``states`` (the first step's hidden states, in and out), ``kv`` (the whole cache), ``held`` (the cache kept in
    RAM; False: spilled), ``steps_most`` (token steps at most: the largest ``max_gen_toks``), ``read_bytes`` (what
    each token step reads of the weights), ``read_per_s`` (the weights' disk, cold; None: not probed) and ``rows``
    (the requests a later step runs through a layer as one batch at once)."""

    budget: int
    steps: dict[str, int]
    states: int
    kv: int
    held: bool
    steps_most: int
    read_bytes: int
    read_per_s: float | None
    rows: int = 1

    def line(self, requests: int, where: Path) -> str:
        """The estimate in one line, said before the generation starts."""
        kv = f"KV cache {format_size(self.kv)} " + ("held in RAM" if self.held else f"spilled to {where}")
        said = (f"generate_until: {requests} request(s), up to {self.steps_most} token step(s), each reading "
                f"{format_size(self.read_bytes)} of weights once for every request; {kv}; budget "
                f"{format_size(self.budget)}")
        if self.read_per_s:
            floor = self.read_bytes / self.read_per_s
            said += (f"; read floor {floor:.2f} s a step at {format_size(int(self.read_per_s))}/s cold, "
                     f"{floor * self.steps_most:.0f} s at most in all")
        return said


def gen_plan(stream: ModelStream, asked: Sequence[Wanted], shape: KVShape, max_memory: int | None,
             files: Sequence[Path]) -> GenPlan:
    """The plan of generating ``asked`` on ``stream``'s model (``shape``: its cache) under ``max_memory``; refuses
    (:class:`UsageError`, exit 2) before any weight is read where even a spilled cache does not fit, naming the
    smallest budget that does. ``files``: the model's weight files here (the largest is probed for its disk's
    cold read speed; none: the time is not estimated)."""
    contexts = [list(w.tokens) for w in asked]
    sizes = step_bytes([stream], contexts)
    text = stream.config.get_text_config()
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    longest = max(map(len, contexts), default=1)
    scores = 2 * heads * longest * longest * _FLOAT  # one request's attention scores and weights, its first step
    room = [len(w.tokens) + w.most for w in asked]
    # a step holds its layer beside a batch of requests' pasts at it, read (spilled) and left-padded into one batch,
    # grown by the layer, and each request's part kept (:mod:`.rowbatch`): as many requests at once as hold no more
    # than the layer itself or 64 MiB (thousands of long requests' pasts would hold more than the whole model), and
    # at least one
    longest_kept = max((shape.kept(layer, r) for layer in range(shape.layers) for r in room), default=0)
    per_row = 3 * longest_kept * shape.position_bytes
    rows = max(1, min(len(room), max(max(sizes.layers), _ROWS_HELD) // max(per_row, 1)))
    layer = max(sizes.layers) + scores + rows * per_row
    steps = {"layer": layer, "heads": head_step_bytes(stream, len(asked), 1)}
    states = 2 * sum(map(len, contexts)) * int(getattr(text, "hidden_size", 0) or 0) * _FLOAT
    kv = sum(shape.cache_bytes(r) for r in room)  # a windowed layer's window, not the whole sequence
    largest = max(steps.values())
    held = True
    try:
        budget = budget_fitting("the generation", states + largest + kv, max_memory, SystemProbe())
    except UsageError:
        held = False
        budget = budget_fitting("the generation, its KV cache spilled to disk", states + largest, max_memory,
                                SystemProbe())
    return GenPlan(budget, steps, states, kv, held, max((w.most for w in asked), default=0),
                   step_read_bytes(stream), _read_speed(files), rows)


def least_bytes(stream: ModelStream) -> int:
    """The least a generation of any request holds beside the process: its largest decoder layer (or embeddings) in
    float32, or the head with one request's logits (what is judged before any weight is read, the requests not yet
    known: :func:`gen_plan` judges them all once they are)."""
    return max(max(step_bytes([stream], [[0]]).layers), head_step_bytes(stream, 1, 1))


def step_read_bytes(stream: ModelStream) -> int:
    """The stored bytes a token step reads: every tensor of the model but the input embeddings, of which only the
    new tokens' rows (a few kB) are read; with them where the head is tied to them (the head reads them whole)."""
    embeddings = stream.prefix(stream.model.get_input_embeddings())
    formats = stream.formats
    total = 0
    for name, found in formats.logical().items():
        if name.startswith(embeddings) and not stream.tied_head():
            continue
        total += found.entry.nbytes + sum(c.entry.nbytes for _, c in formats.companions(name))
    return total


def _read_speed(files: Sequence[Path]) -> float | None:
    """The cold read speed of the largest of ``files`` (None: none is here)."""
    from resumerge.machine.diskprobe import probe_file_read

    here = [f for f in files if f.is_file()]
    if not here:
        return None
    return probe_file_read(max(here, key=lambda f: f.stat().st_size))
