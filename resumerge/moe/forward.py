"""The prompt forward pass of the hidden-state gate modes, one decoder layer at a time.

mergekit-moe loads the whole base model in bfloat16 and runs every prompt set through it; here transformers' own
modules for the base's architecture are built without weights (on the meta device), and each one gets its
weights read from the base's files only while it runs, then drops them. Between layers only the prompt sets'
hidden states are carried; they are saved after every layer (temp file, fsync, rename), so a killed pass resumes
at the layer it reached, and the finished routers are kept, so a later resume never reruns the pass.

Routers follow mergekit-moe 0.1.5: the input of layer ``i`` of each prompt (the embeddings for layer 0) at the
last position (``hidden``, ``hidden_last``) or averaged over all positions, padding included (``hidden_avg``),
averaged over the set's prompts; a negative set's vector subtracted; each layer's vector divided by its L2 norm;
all in bfloat16.

A quantized base (block FP8, compressed-tensors, MXFP4) is read through the run's codecs, as the merge reads it:
each tensor decoded to float32, then cast to bfloat16 (a plain tensor is cast straight from its stored bytes), so
the pass sees the values ``--dequantize`` would write.

The pass runs on the layer-streamed forward engine (:mod:`resumerge.forward`), the one ``resumerge check`` runs
on, a client of its one journaled layer pass like ``check`` and ``measure``: its embeddings and each decoder layer
admitted by the RAM governor under the share of the budget its process is given
(:class:`~resumerge.forward.admission.Admission`). This module adds the prompt sets' vectors, the journal's layout
and the routers. The base's layers run where the pass's :class:`~resumerge.forward.placement.Placement` runs them:
in this process (:func:`hidden_routers`), or where the run's executor places them (:func:`placed_routers`: an
actor on a Ray node); the step, its journal and its routers are the same either way, so a pass killed in one place
resumes in the other with the same bytes.

:func:`hidden_routers` runs in the prompt work's own process (:mod:`resumerge.moe.passmain`): transformers is
imported there, never in the merge's process; :func:`placed_routers` runs in the merge's process, which then holds
only the prompt sets' hidden states (the node imports transformers).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.errors import InputError
from resumerge.forward import Weights, durable_save, pass_bytes
from resumerge.forward.admission import Admission
from resumerge.forward.batches import Hidden
from resumerge.forward.folder import pass_lock
from resumerge.forward.journal import Journal
from resumerge.forward.layerpass import LayerPass, Reserve, Step, unreserved
from resumerge.forward.opened import PassModel
from resumerge.forward.placement import Placement, Places, Streams
from resumerge.forward.requires import require_transformers
from resumerge.forward.stream import ModelStream
from resumerge.memory import SystemProbe
from resumerge.moe.passproc import gate_needs
from resumerge.moe.passshare import share_problem
from resumerge.moe.routers import Encoded
from resumerge.moe.state import LAYER_PREFIX, ROUTERS_NAME
from resumerge.torch_import import torch

__all__ = ["ExpertSets", "Ready", "Weights", "hidden_routers", "pass_bytes", "pass_checks", "placed_routers"]

_BASE = "base"

# (positive, negative or None) encoded prompt sets of each gated expert
ExpertSets = Sequence[tuple[Encoded, Encoded | None]]


@dataclass(frozen=True)
class Ready:
    """What the pass's checks built: the base's modules without weights (config and model, as the forward engine
    builds them: :func:`resumerge.forward.stream.build_modules`) and every gated expert's encoded prompt sets."""

    config: Any
    model: Any
    sets: ExpertSets


def pass_checks(directory: Path, tokenizer_dir: Path, mode: str,
                prompts: Sequence[tuple[Sequence[str], Sequence[str] | None]]) -> Ready:
    """Every check of the pass before its first weight, which ``plan`` makes too: transformers imports, reads the
    base's config.json and builds its modules (without weights), loads its tokenizer and encodes the prompts.
    ``plan``'s probe of the pass and the run's pass both call this one function (:mod:`.passmain`), and the run
    waits for it before the merge writes anything, so what ``plan`` refuses here ``run`` refuses before its first
    weight (raises InputError subclasses)."""
    from resumerge.forward.stream import build_modules
    from resumerge.moe.prompts import encode, load_tokenizer

    transformers = require_transformers(gate_needs(mode))
    try:
        config, model = build_modules(directory, torch.bfloat16, what=f"gate_mode {mode}")
    except (OSError, ValueError, KeyError) as exc:  # an architecture this transformers does not know
        raise InputError(f"transformers {transformers.__version__} cannot build the base model from {directory}: "
                         f"{exc}", yaml_path="base_model",
                         hint=f"the {mode} gate mode runs the base in transformers: pip install -U transformers, or "
                              "use gate_mode cheap_embed or random") from None
    tokenizer = load_tokenizer(tokenizer_dir, mode)
    sets = [(encode(tokenizer, positive), encode(tokenizer, negative) if negative else None)
            for positive, negative in prompts]
    return Ready(config, model, sets)


def hidden_routers(weights: Weights, mode: str, sets: ExpertSets, workdir: Path, *,
                   config_doc: Mapping[str, Any] | None = None, share: int | None = None,
                   counted_elsewhere: int = 0, run_pid: int | None = None, ready: Ready | None = None,
                   on_checked: Callable[[], None] | None = None, locks: Path | None = None) -> Path:
    """Compute (or find, when an earlier run finished it) the routers of every layer into ``workdir`` and return
    the file: tensor ``layers.<i>`` of shape (gated experts, hidden), bfloat16.

    ``config_doc`` is the base's config as the run read it (None: its folder's config.json), which says how
    the codecs read its tensors (a GGUF base's rebuilt config.json does not: its tensors are the GGUF's).
    ``share`` is the memory budget this process may hold (counted as the governor counts it): a pass whose
    largest layer cannot fit is refused before any weight is read (UsageError naming the smallest budget; the
    run's process holds ``counted_elsewhere`` more), and the embeddings and each layer are then admitted by a RAM
    governor under it, as each step of ``check`` and ``measure`` is (None: not admitted, a test's pass).
    ``run_pid`` is the run's process, the one a kill test kills.
    ``ready`` is what :func:`pass_checks` built (None: built here); ``on_checked`` is called once every check is
    made, before the first weight is read (the run's merge waits for it).
    ``locks``: the folder of the passes' locks (the run's state dir's
    :attr:`~resumerge.config.locations.StateDir.router_locks_dir`; None: unlocked, a test's pass): see :func:`_gates`.
    """
    done = workdir / ROUTERS_NAME
    if done.is_file():
        return done
    workdir.mkdir(parents=True, exist_ok=True)
    require_transformers(gate_needs(mode))
    if config_doc is None:
        config_doc = json.loads((weights.directory / "config.json").read_text())
    built = None if ready is None else (ready.config, ready.model)
    with ModelStream(weights, config_doc, torch.bfloat16, what=f"gate_mode {mode}", key=_BASE,
                     built=built) as stream:
        layers = stream.layers
        step_bytes = pass_bytes(stream.formats, layers)
        if share is not None:
            _check_share(step_bytes, share, counted_elsewhere)
        if on_checked is not None:
            on_checked()
        admitted: AbstractContextManager[Reserve] = Admission(share, {"layer": step_bytes}) if share is not None \
            else nullcontext(unreserved)
        with admitted as reserve:
            _gates(Streams([stream], reserve=reserve, names=["the base"]), layers, mode, sets, workdir, reserve,
                   run_pid, locks)
    return done


def placed_routers(places: Places, base: PassModel, layers: int, need: int, mode: str, sets: ExpertSets,
                   workdir: Path, *, locks: Path | None = None) -> Path:
    """:func:`hidden_routers` with the base's layers where ``places`` puts them (the run's executor: an actor on a
    Ray node, which reads the base and imports transformers), this process driving the pass: it holds the prompt
    sets' hidden states, journals them and makes the routers, exactly as the local pass does (its journal is the
    same file: a pass killed locally resumes here, and the other way round). ``base``: the base model opened
    (its folder, tensors and config as the run read them); ``need``: what its part of the pass holds at its
    largest step (refused, exit 2, where no node holds it); ``locks``: as :func:`hidden_routers`'."""
    done = workdir / ROUTERS_NAME
    if done.is_file():
        return done
    workdir.mkdir(parents=True, exist_ok=True)
    with places([base], layers, [need], torch.bfloat16) as placement:
        _gates(placement, layers, mode, sets, workdir, unreserved, None, locks)
    return done


def _gates(placement: Placement, layers: int, mode: str, sets: ExpertSets, workdir: Path, reserve: Reserve,
           run_pid: int | None, locks: Path | None) -> None:
    """The pass over ``placement``'s one model (the base) from its journal in ``workdir``: every prompt set a batch,
    the embeddings held by ``reserve``, then :class:`_GateStep` over the layers and the routers after the last.

    Under the pass's lock (``locks``/KEY, beside the folder: one process at a time journals in it, else one run's
    :func:`_finish` deletes the layer files another still reads). Two runs of the same gates into two OUTs share the
    folder by content, so the second waits for the first instead of being refused as a second ``check`` is, then
    finds its routers (or, the first killed, resumes its journal)."""
    lock = nullcontext() if locks is None else pass_lock(
        locks, f"the prompt forward pass {workdir.name}", f"the prompt forward pass into {workdir}",
        hint="wait for it to finish", name=workdir.name, wait=True)
    with lock:
        if (workdir / ROUTERS_NAME).is_file():  # the run it waited for made them
            return
        _journaled(placement, layers, mode, sets, workdir, reserve, run_pid)


def _journaled(placement: Placement, layers: int, mode: str, sets: ExpertSets, workdir: Path, reserve: Reserve,
               run_pid: int | None) -> None:
    """:func:`_gates`' pass, its lock held."""
    flat = [s for pair in sets for s in pair if s is not None]
    with torch.no_grad(), reserve("the base's embeddings", "layer"):
        entering = placement.enter([(torch.tensor(s[0]), torch.tensor(s[1])) for s in flat])
    journal = Journal(workdir, LAYER_PREFIX, hidden="hidden.{s}", keeps_older=True)
    gates = LayerPass(journal, layers, point="after_router_layer", run_pid=run_pid, carries=placement)
    gates.run(_GateStep(placement, layers, mode, journal, sets), entering, len(flat))


def _vector(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """One prompt set's vector at one layer: (batch, seq, hidden) -> (hidden,), as mergekit reduces it."""
    per_prompt = hidden.sum(dim=1) / hidden.shape[1] if mode == "hidden_avg" else hidden[:, -1, :]
    return per_prompt.sum(dim=0) / per_prompt.shape[0]


def _check_share(step_bytes: int, share: int, counted_elsewhere: int) -> None:
    probe = SystemProbe()
    probe.reclaim()
    problem = share_problem(probe.rss(), step_bytes, share, counted_elsewhere)
    if problem is not None:
        raise problem


class _GateStep(Step[None]):
    """The gates' part of the pass: at each layer every prompt set's vector of the layer's input (journaled beside
    the hidden states, each layer's file kept), the layer run by the ``placement`` to give the next its input (not
    the last layer's: its output is no router's input); after the last layer, the routers (:func:`_finish`)."""

    def __init__(self, placement: Placement, layers: int, mode: str, journal: Journal, sets: ExpertSets) -> None:
        self.placement, self.layers, self.mode, self.journal, self.sets = placement, layers, mode, journal, sets
        self.vectors: list[torch.Tensor] = []

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        self.vectors = [_vector(h, self.mode) for h in hidden[0]]
        if index + 1 == self.layers:
            return [[]]
        own, _ = self.placement.layer(index, hidden, None)
        return own

    def kept(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
        return {f"vector.{s}": v.contiguous() for s, v in enumerate(self.vectors)}, None

    def finish(self, hidden: Hidden) -> None:
        _finish(self.journal, self.sets, self.layers)


def _finish(journal: Journal, sets: ExpertSets, layers: int) -> None:
    """Each layer's routers from its journaled vectors into ``routers.safetensors``; the layer files deleted."""
    routers = {}
    for i in range(layers):
        data = journal.read(i)
        index, rows = 0, []
        for _, negative in sets:
            vector = data[f"vector.{index}"].clone()
            index += 1
            if negative is not None:
                vector -= data[f"vector.{index}"]
                index += 1
            rows.append(vector.unsqueeze(0))
        gates = torch.cat(rows, dim=0)
        gates /= gates.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        routers[f"layers.{i}"] = gates.contiguous()
    durable_save(routers, journal.folder / ROUTERS_NAME)
    journal.clear()
