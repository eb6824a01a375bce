"""The forward pass of a check: every model (the merge first) run one decoder layer at a time over the same token
sequences, on the forward engine (:mod:`resumerge.forward`), in float32.

At layer l each model's layer is read once and run twice: on that model's own hidden states (its real forward),
and on the reference's input to the layer (the base's, else the first parent's), so the merge's and each other
model's outputs for the same input can be compared (the localising pass). Only one layer of one model is held,
plus every model's hidden states. After each layer the hidden states and the figures so far are saved (temp file,
fsync, rename) and the previous layer's file deleted: a killed check resumes at the layer it reached and ends
with the same figures. The heads run last, one model and one batch at a time (:mod:`resumerge.check.heads`).

The sequences run in batches (:func:`batches_of`: padded on the right to the longest of the batch, with the
attention mask), so a layer is one call over many sequences rather than one per sequence: a causal layer's output
at a real position never sees the padding after it, and every figure is taken over real positions only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.check.heads import head_figures
from resumerge.check.models import Checked
from resumerge.forward import Weights, durable_save
from resumerge.forward.journal import latest
from resumerge.forward.stream import LayerCall, ModelStream
from resumerge.store.killpoints import reach
from resumerge.torch_import import torch

LAYER_PREFIX = "layer-"
# The padded tokens (sequences x longest) a batch may hold: a layer's activations (an MLP's widest, 1024 x its
# intermediate size in float32) stay about 100 MB on a 70B model.
BATCH_TOKENS = 1024
# Holds the memory of one step of the pass while it runs: (what, step) -> a context manager.
Reserve = Callable[[str, str], AbstractContextManager[object]]
_TINY = 1e-12


@dataclass(frozen=True)
class PassFigures:
    """Per model (the merge first): ``nll``; ``kl``, ``kl_p95``, ``top1`` of the merge from it (None for the
    merge); per layer ``drift`` (of the merge's hidden states from its) and ``depart`` (of the merge's layer
    output from its, on the same input, relative to its layer's own change of that input); per layer the
    ``spread`` of the other models' outputs among themselves, on that input; ``base_kl`` KL(base ‖ this) for each
    parent where there is a base (the yardstick of "no effect")."""

    nll: list[float]
    kl: list[float | None]
    kl_p95: list[float | None]
    top1: list[float | None]
    drift: list[list[float]]
    depart: list[list[float]]
    spread: list[float]
    tokens: int
    base_kl: list[float | None]


def _unreserved(what: str, step: str) -> AbstractContextManager[object]:
    return nullcontext()


def streams_of(models: Sequence[Checked]) -> list[ModelStream]:
    """Each model's modules without weights (read as the pass runs). Models whose config.json says the same share
    one set of modules (built once: 0.9 s each for SmolLM2-135M): the pass gives a module its weights only while
    it runs, one model at a time, and takes them away after."""
    import json

    built: dict[str, tuple[Any, Any]] = {}
    streams = []
    for m in models:
        same = json.dumps(m.opened.config, sort_keys=True)
        stream = ModelStream(Weights.of(m.opened.directory, m.opened.tensors, m.remote), m.opened.config,
                             torch.float32, what="resumerge check", key=m.role, built=built.get(same))
        built.setdefault(same, (stream.config, stream.model))
        streams.append(stream)
    return streams


def forward_pass(models: Sequence[Checked], streams: Sequence[ModelStream], sequences: Sequence[Sequence[int]],
                 workdir: Path, on_model: Callable[[int, int], None] | None = None,
                 reserve: Reserve = _unreserved) -> PassFigures:
    """Run the pass (resuming the one journaled in ``workdir``) and return its figures; ``on_model(layer, m)``
    is told before model ``m``'s layer is read (``status`` shows it); ``reserve(what, step)`` holds the memory
    of a step (``layer``: one model's layer; ``heads``: two models' heads and log-probabilities) while it runs."""
    workdir.mkdir(parents=True, exist_ok=True)
    roles = [m.role for m in models]
    reference = roles.index("base") if "base" in roles else (1 if len(models) > 1 else None)
    groups = batches_of(sequences)
    layers = streams[0].layers
    with torch.no_grad():
        batches = [_padded([sequences[i] for i in group]) for group in groups]
        entering = [stream.inputs_of_rows(batches) for stream in streams]
        if any(len(g) > 1 for g in groups) and not _runs_batched(streams[0], entering[0], reserve):
            groups = [[i] for g in groups for i in g]  # this family's layers take one sequence at a time
            batches = [_padded([sequences[i] for i in group]) for group in groups]
            entering = [stream.inputs_of_rows(batches) for stream in streams]
        real = [mask.bool() for _, mask in batches]
        calls = [[c for _, c in model] for model in entering]
        start, hidden, stats = _restart(workdir, len(models), len(batches))
        if hidden is None:
            hidden = [[h for h, _ in model] for model in entering]
        for index in range(start, layers):
            hidden, row = _layer(streams, index, hidden, calls, reference, real, on_model, reserve)
            stats.append(row)
            _save(workdir, index, hidden, stats)
            reach("after_check_layer")  # tests kill the check here: it resumes after this layer
        with reserve("the heads", "heads"):
            return _heads(streams, hidden, [[sequences[i] for i in g] for g in groups], stats,
                          roles.index("base") if "base" in roles else None, workdir)


def _runs_batched(stream: ModelStream, entering: list[tuple[torch.Tensor, list[LayerCall]]],
                  reserve: Reserve = _unreserved) -> bool:
    """Whether the model's first decoder layer runs a padded batch (some families' attention, as transformers
    ships it, cannot: DeepSeek-V3's with a padding mask); decided from the model alone, so a resumed check decides
    the same."""
    with reserve("layer 0 of model 1 (can it run batches?)", "layer"), stream.loaded(stream.layers_list[0]) as layer:
        try:
            for hidden, calls in entering:
                stream.run(layer, hidden, calls[0])
        except RuntimeError:
            return False
    return True


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


def _padded(batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded on the right with id 0 (never attended to: it comes after every real token) and the
    attention mask, both (batch, longest)."""
    longest = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, :len(s)] = torch.tensor(list(s))
        mask[row, :len(s)] = 1
    return ids, mask


def _layer(streams: Sequence[ModelStream], index: int, hidden: list[list[torch.Tensor]],
           calls: list[list[list[LayerCall]]], reference: int | None, real: list[torch.Tensor],
           on_model: Callable[[int, int], None] | None = None, reserve: Reserve = _unreserved,
           ) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Every model's layer ``index`` on its own hidden states and on the reference's; the layer's figures: per
    model its drift and departure, then the spread."""
    same_input = hidden[reference] if reference is not None else None
    own, on_same = [], []
    for m, stream in enumerate(streams):
        if on_model is not None:
            on_model(index, m)
        with reserve(f"layer {index} of model {m + 1}", "layer"), stream.loaded(stream.layers_list[index]) as layer:
            out = [stream.run(layer, h, calls[m][s][index]) for s, h in enumerate(hidden[m])]
            own.append(out)
            if same_input is None or m == reference:
                on_same.append(out)
            else:
                on_same.append([stream.run(layer, h, calls[m][s][index]) for s, h in enumerate(same_input)])
    drift = [0.0] + [_relative(own[0], own[m], real) for m in range(1, len(streams))]
    depart, spread = [0.0] * len(streams), 0.0
    if same_input is not None:
        depart = [0.0] + [_relative(on_same[0], on_same[m], real, same_input) for m in range(1, len(streams))]
        others = range(1, len(streams))
        spread = max((_relative(on_same[a], on_same[b], real, same_input) for a in others for b in others
                      if a != b), default=0.0)
    return own, [*drift, *depart, spread]


def _relative(merge: list[torch.Tensor], other: list[torch.Tensor], real: list[torch.Tensor],
              entering: list[torch.Tensor] | None = None) -> float:
    """‖merge − other‖ / ‖other − entering‖ over the real positions of every batch (``entering`` None:
    / ‖other‖)."""
    gap = sum(float((a[r] - b[r]).double().pow(2).sum()) for a, b, r in zip(merge, other, real))
    scale = sum(float((b[r] if entering is None else b[r] - x[r]).double().pow(2).sum())
                for b, x, r in zip(other, entering if entering is not None else other, real))
    return float((gap / max(scale, _TINY)) ** 0.5)


def _save(workdir: Path, index: int, hidden: list[list[torch.Tensor]], stats: list[list[float]]) -> None:
    tensors = {f"hidden.{m}.{s}": h.contiguous() for m, model in enumerate(hidden) for s, h in enumerate(model)}
    tensors["stats"] = torch.tensor(stats, dtype=torch.float64)
    durable_save(tensors, workdir / f"{LAYER_PREFIX}{index:05d}.safetensors")
    for older in workdir.glob(f"{LAYER_PREFIX}*.safetensors"):
        if older.name != f"{LAYER_PREFIX}{index:05d}.safetensors":
            older.unlink(missing_ok=True)


def _restart(workdir: Path, models: int, sequences: int
             ) -> tuple[int, list[list[torch.Tensor]] | None, list[list[float]]]:
    found = latest(workdir, LAYER_PREFIX)
    if found is None:
        return 0, None, []
    from safetensors.torch import load_file

    layer, path = found
    data = load_file(str(path))
    hidden = [[data[f"hidden.{m}.{s}"] for s in range(sequences)] for m in range(models)]
    return layer + 1, hidden, [list(map(float, row)) for row in data["stats"].tolist()]


def _heads(streams: Sequence[ModelStream], hidden: list[list[torch.Tensor]],
           batches: Sequence[Sequence[Sequence[int]]], stats: list[list[float]], base: int | None,
           workdir: Path) -> PassFigures:
    """The pass's figures: the heads' (:func:`~resumerge.check.heads.head_figures`, streamed) and the layers'."""
    n = len(streams)
    found = head_figures(streams, hidden, batches, base, workdir)
    drift = [[row[m] for row in stats] for m in range(n)]
    depart = [[row[n + m] for row in stats] for m in range(n)]
    return PassFigures(nll=found.nll, kl=found.kl, kl_p95=found.kl_p95, top1=found.top1, drift=drift,
                       depart=depart, spread=[row[2 * n] for row in stats], tokens=found.tokens,
                       base_kl=found.base_kl)
