"""The forward pass of a check: every model (the merge first) run one decoder layer at a time over the same token
sequences, on the forward engine (:mod:`resumerge.forward`), in float32.

At layer l each model's layer is read once and run twice: on that model's own hidden states (its real forward),
and on the reference's input to the layer (the base's, else the first parent's), so the merge's and each other
model's outputs for the same input can be compared (the localising pass). Only one layer of one model is held,
plus every model's hidden states. After each layer the hidden states and the figures so far are saved (temp file,
fsync, rename) and the previous layer's file deleted: a killed check resumes at the layer it reached and ends
with the same figures. The head runs last: the merge's and one other model's at a time, a sequence at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from resumerge.check.models import Checked
from resumerge.forward import Weights, durable_save
from resumerge.forward.journal import latest
from resumerge.forward.stream import LayerCall, ModelStream
from resumerge.store.killpoints import reach
from resumerge.torch_import import torch

LAYER_PREFIX = "layer-"
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
    """Each model's modules without weights (read as the pass runs)."""
    return [ModelStream(Weights.of(m.opened.directory, m.opened.tensors, m.remote), m.opened.config, torch.float32,
                        what="resumerge check", key=m.role) for m in models]


def forward_pass(models: Sequence[Checked], streams: Sequence[ModelStream], sequences: Sequence[Sequence[int]],
                 workdir: Path, on_model: Callable[[int, int], None] | None = None,
                 reserve: Reserve = _unreserved) -> PassFigures:
    """Run the pass (resuming the one journaled in ``workdir``) and return its figures; ``on_model(layer, m)``
    is told before model ``m``'s layer is read (``status`` shows it); ``reserve(what, step)`` holds the memory
    of a step (``layer``: one model's layer; ``heads``: two models' heads and log-probabilities) while it runs."""
    workdir.mkdir(parents=True, exist_ok=True)
    roles = [m.role for m in models]
    reference = roles.index("base") if "base" in roles else (1 if len(models) > 1 else None)
    batches = [(torch.tensor([list(s)]), torch.ones(1, len(s), dtype=torch.long)) for s in sequences]
    layers = streams[0].layers
    with torch.no_grad():
        entering = [stream.inputs(batches) for stream in streams]
        calls = [[c for _, c in model] for model in entering]
        start, hidden, stats = _restart(workdir, len(models), len(sequences))
        if hidden is None:
            hidden = [[h for h, _ in model] for model in entering]
        for index in range(start, layers):
            hidden, row = _layer(streams, index, hidden, calls, reference, on_model, reserve)
            stats.append(row)
            _save(workdir, index, hidden, stats)
            reach("after_check_layer")  # tests kill the check here: it resumes after this layer
        with reserve("the heads", "heads"):
            return _heads(streams, hidden, sequences, stats, roles.index("base") if "base" in roles else None)


def _layer(streams: Sequence[ModelStream], index: int, hidden: list[list[torch.Tensor]],
           calls: list[list[list[LayerCall]]], reference: int | None,
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
    drift = [0.0] + [_relative(own[0], own[m]) for m in range(1, len(streams))]
    depart, spread = [0.0] * len(streams), 0.0
    if same_input is not None:
        depart = [0.0] + [_relative(on_same[0], on_same[m], same_input) for m in range(1, len(streams))]
        others = range(1, len(streams))
        spread = max((_relative(on_same[a], on_same[b], same_input) for a in others for b in others if a != b),
                     default=0.0)
    return own, [*drift, *depart, spread]


def _relative(merge: list[torch.Tensor], other: list[torch.Tensor], entering: list[torch.Tensor] | None = None
              ) -> float:
    """‖merge − other‖ / ‖other − entering‖ over all positions (``entering`` None: / ‖other‖)."""
    gap = sum(float((a - b).double().pow(2).sum()) for a, b in zip(merge, other))
    scale = sum(float((b if entering is None else b - x).double().pow(2).sum())
                for b, x in zip(other, entering if entering is not None else other))
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


def _heads(streams: Sequence[ModelStream], hidden: list[list[torch.Tensor]], sequences: Sequence[Sequence[int]],
           stats: list[list[float]], base: int | None) -> PassFigures:
    n = len(streams)
    targets = [torch.tensor(list(s[1:])) for s in sequences]
    nll: list[float] = [0.0] * n
    kl: list[float | None] = [None] * n
    p95: list[float | None] = [None] * n
    top1: list[float | None] = [None] * n
    base_kl: list[float | None] = [None] * n
    base_lp: list[torch.Tensor] = []
    tokens = sum(len(t) for t in targets)
    with streams[0].head() as merge_head:
        merged = [torch.log_softmax(merge_head(h)[0, :-1].float(), dim=-1) for h in hidden[0]]
    nll[0] = _nll(merged, targets, tokens)
    for m in range(1, n):
        with streams[m].head() as head:
            theirs = [torch.log_softmax(head(h)[0, :-1].float(), dim=-1) for h in hidden[m]]
        nll[m] = _nll(theirs, targets, tokens)
        if m == base:
            base_lp = theirs
        elif base is not None:
            base_kl[m] = float(torch.cat([_kl(b, t) for b, t in zip(base_lp, theirs)]).double().mean())
        per_position = torch.cat([_kl(t, o) for t, o in zip(theirs, merged)])
        kl[m] = float(per_position.double().mean())
        p95[m] = float(torch.quantile(per_position.double(), 0.95))
        top1[m] = float(sum(int((t.argmax(-1) == o.argmax(-1)).sum()) for t, o in zip(theirs, merged)) / tokens)
    drift = [[row[m] for row in stats] for m in range(n)]
    depart = [[row[n + m] for row in stats] for m in range(n)]
    return PassFigures(nll=nll, kl=kl, kl_p95=p95, top1=top1, drift=drift, depart=depart,
                       spread=[row[2 * n] for row in stats], tokens=tokens, base_kl=base_kl)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ other) at each position, from log-probabilities."""
    return (reference.exp() * (reference - other)).sum(dim=-1)


def _nll(logprobs: list[torch.Tensor], targets: list[torch.Tensor], tokens: int) -> float:
    total = sum(float(-lp.gather(-1, t.unsqueeze(-1)).double().sum()) for lp, t in zip(logprobs, targets))
    return total / tokens
