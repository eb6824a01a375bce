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
on, a job of its one pass driver like ``check`` and ``measure`` (:class:`GatesJob`, handed to
:func:`~resumerge.forward.job.driver.drive`): its embeddings and each decoder layer admitted by the RAM governor under
the share of the budget its process is given (:class:`~resumerge.forward.job.admission.Admission`). This module adds
the prompt sets' vectors, the journal's layout and the routers. The base's layers run where the pass's
:class:`~resumerge.forward.job.placement.Placement` runs them: in this process (:class:`InThisProcess`,
:func:`hidden_routers`), or where the run's executor places them (:class:`Placed`, :func:`placed_routers`: an
actor on a Ray node); the step, its journal and its routers are the same either way, so a pass killed in one place
resumes in the other with the same bytes.

:func:`hidden_routers` runs in the prompt work's own process (:mod:`resumerge.runs.moe.passmain`): transformers is
imported there, never in the merge's process; :func:`placed_routers` runs in the merge's process, which then holds
only the prompt sets' hidden states (the node imports transformers).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resumerge.errors import InputError
from resumerge.forward.engine.reader import Weights, pass_bytes
from resumerge.forward.engine.requires import require_transformers
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import Fit, PassFolder, drive
from resumerge.forward.job.journal import Journal, durable_save
from resumerge.forward.job.layerpass import LayerPass, Reserve, Step
from resumerge.forward.job.placement import Placement, Places, Streams
from resumerge.forward.opening.opened import PassModel
from resumerge.forward.text.batches import Hidden
from resumerge.machine.memory import SystemProbe
from resumerge.machine.threadcount import THREADS_FILE
from resumerge.machine.torch_import import torch
from resumerge.runs.moe.passproc import gate_needs
from resumerge.runs.moe.passshare import share_problem
from resumerge.runs.moe.routers import Encoded
from resumerge.runs.moe.state import LAYER_PREFIX, ROUTERS_NAME

__all__ = ["ExpertSets", "GatesJob", "InThisProcess", "Placed", "Ready", "Weights", "hidden_routers", "pass_bytes",
           "pass_checks", "placed_routers"]

_BASE = "base"

# (positive, negative or None) encoded prompt sets of each gated expert
ExpertSets = Sequence[tuple[Encoded, Encoded | None]]


@dataclass(frozen=True)
class Ready:
    """What the pass's checks built: the base's modules without weights (config and model, as the forward engine
    builds them: :func:`resumerge.forward.engine.built.build_modules`) and every gated expert's encoded prompt sets."""

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
    from resumerge.forward.engine.built import build_modules
    from resumerge.runs.moe.prompts import encode, load_tokenizer

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


def hidden_routers(site: InThisProcess, sets: ExpertSets, workdir: Path, *, run_pid: int | None = None,
                   locks: Path | None = None) -> Path:
    """Compute (or find, when an earlier run finished it) the routers of every layer into ``workdir`` and return
    the file: tensor ``layers.<i>`` of shape (gated experts, hidden), bfloat16; the base's layers run in this
    process as ``site`` says (:class:`InThisProcess`: its weights, gate mode, budget and checks), the pass driven
    as :class:`GatesJob`. ``run_pid`` is the run's process, the one a kill test kills. ``locks``: the folder of the
    passes' locks (the run's state dir's :attr:`~resumerge.config.locations.StateDir.router_locks_dir`; None:
    beside ``workdir``, a test's pass): see :class:`GatesJob`.
    """
    return drive(GatesJob(gates_folder(workdir, locks), workdir, site.mode, sets, site, run_pid))


def placed_routers(places: Places, base: PassModel, layers: int, need: int, mode: str, sets: ExpertSets,
                   workdir: Path, *, locks: Path | None = None) -> Path:
    """:func:`hidden_routers` with the base's layers where ``places`` puts them (:class:`Placed`: the run's
    executor, an actor on a Ray node, which reads the base and imports transformers), this process driving the
    pass: it holds the prompt sets' hidden states, journals them and makes the routers, exactly as the local pass
    does (its journal is the same file: a pass killed locally resumes here, and the other way round). ``base``:
    the base model opened (its folder, tensors and config as the run read it); ``need``: what its part of the pass
    holds at its largest step (refused, exit 2, where no node holds it); ``locks``: as :func:`hidden_routers`'."""
    return drive(GatesJob(gates_folder(workdir, locks), workdir, mode, sets, Placed(places, base, layers, need)))


# What a pass's fit made of where its base runs: given the driver's reserve (its admission), the placement.
Placing = Callable[[Reserve], Placement]


class FitsBase(Protocol):
    """Fits the base's layers where the gates' pass runs them, before any weight is read (:meth:`GatesJob.fitted`):
    in this process (:class:`InThisProcess`) or where the executor placed them (:class:`Placed`)."""

    def fitted(self) -> AbstractContextManager[Fit[Placing]]: ...


@dataclass(frozen=True)
class InThisProcess:
    """The base's layers (``weights``) streamed in this process (the prompt work's own: :mod:`.passmain`) for the
    gate ``mode``, each read only while it runs.

    ``config_doc`` is the base's config as the run read it (None: its folder's config.json), which says how the
    codecs read its tensors (a GGUF base's rebuilt config.json does not: its tensors are the GGUF's). ``share`` is
    the memory budget this process may hold (counted as the governor counts it): a pass whose largest layer cannot
    fit is refused before any weight is read (UsageError naming the smallest budget; the run's process holds
    ``counted_elsewhere`` more), and the embeddings and each layer are then admitted by a RAM governor under it, as
    each step of ``check`` and ``measure`` is (None: not admitted, a test's pass). ``ready`` is what
    :func:`pass_checks` built (None: built here); ``on_checked`` is called once every check is made, before the
    first weight is read (the run's merge waits for it)."""

    weights: Weights
    mode: str
    config_doc: Mapping[str, Any] | None = None
    share: int | None = None
    counted_elsewhere: int = 0
    ready: Ready | None = None
    on_checked: Callable[[], None] | None = None

    @contextmanager
    def fitted(self) -> Iterator[Fit[Placing]]:
        """The base's modules, its largest layer judged against the share, the checks said made."""
        config_doc = self.config_doc if self.config_doc is not None else \
            json.loads((self.weights.directory / "config.json").read_text())
        built = None if self.ready is None else (self.ready.config, self.ready.model)
        with ModelStream(self.weights, config_doc, torch.bfloat16, what=f"gate_mode {self.mode}", key=_BASE,
                         built=built) as stream:
            step_bytes = pass_bytes(stream.formats, stream.layers)
            if self.share is not None:
                _check_share(step_bytes, self.share, self.counted_elsewhere)
            if self.on_checked is not None:
                self.on_checked()
            yield Fit(self.share, {"layer": step_bytes},
                      lambda reserve: Streams([stream], reserve=reserve, names=["the base"]))


@dataclass(frozen=True)
class Placed:
    """The base's ``layers`` where ``places`` puts them (an actor on a Ray node), declaring ``need`` (what its part
    of the pass holds at its largest step); this process holds the hidden states, unadmitted (the node declared
    the layers' memory)."""

    places: Places
    base: PassModel
    layers: int
    need: int

    @contextmanager
    def fitted(self) -> Iterator[Fit[Placing]]:
        """The base's actor placed (refused, exit 2, where no node holds it), ended with the block."""
        with self.places([self.base], self.layers, [self.need], torch.bfloat16) as placement:
            yield Fit(None, {"layer": self.need}, lambda reserve: placement)


def gates_folder(workdir: Path, locks: Path | None) -> PassFolder:
    """The lock of the gates' pass journaled in ``workdir``: ``locks``/KEY (beside the folder, which then holds its
    routers alone; None: ``workdir``'s own folder, KEY.lock). Two runs of the same gates into two OUTs share the
    folder by content, so the second waits for the first instead of being refused as a second ``check`` is, then
    finds its routers (or, the first killed, resumes its journal). The thread count the pass computes with is kept
    beside its lock, named as it is (KEY.threads.json)."""
    where, name = (locks, workdir.name) if locks is not None else (workdir.parent, f"{workdir.name}.lock")
    return PassFolder(where, f"the prompt forward pass {workdir.name}", f"the prompt forward pass into {workdir}",
                      hint="wait for it to finish", lock_name=name, wait=True,
                      threads=where / f"{workdir.name}.{THREADS_FILE}")


@dataclass(frozen=True)
class GatesJob:
    """The gates' pass as the pass driver runs it (:class:`~resumerge.forward.job.driver.PassJob`): its routers are its
    answer cache; its steps the base's embeddings, then :class:`_GateStep` over the layers from its journal in
    ``workdir`` (every prompt set a batch), the base where ``site`` runs it; the routers written after the last
    layer. Under the pass's lock (``folder``: one process at a time journals in ``workdir``, else one run's
    :func:`_finish` deletes the layer files another still reads). ``run_pid``: the run's process, the one a kill
    test kills."""

    folder: PassFolder
    workdir: Path
    mode: str
    sets: ExpertSets
    site: FitsBase
    run_pid: int | None = None

    def answered(self) -> tuple[Path | None, str | None]:
        """The routers of a pass that finished (a run it waited for made them)."""
        done = self.workdir / ROUTERS_NAME
        return (done if done.is_file() else None), None

    def proved(self) -> str | None:
        """Nothing to prove: the folder's key holds the base's files (their names, sizes and identities)."""
        return None

    @contextmanager
    def fitted(self) -> Iterator[Fit[Placing]]:
        """The folder made, and the site's fit."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.site.fitted() as fit:
            yield fit

    def run(self, ready: Placing, reserve: Reserve) -> None:
        """The embeddings, then every layer from the journal; the routers after the last."""
        placement = ready(reserve)
        flat = [s for pair in self.sets for s in pair if s is not None]
        with torch.no_grad(), reserve("the base's embeddings", "layer"):
            entering = placement.enter([(torch.tensor(s[0]), torch.tensor(s[1])) for s in flat])
        layers = placement.layers
        journal = Journal(self.workdir, LAYER_PREFIX, hidden="hidden.{s}", keeps_older=True)
        gates = LayerPass(journal, layers, point="after_router_layer", run_pid=self.run_pid, carries=placement)
        gates.run(_GateStep(placement, layers, self.mode, journal, self.sets), entering, len(flat))

    def finish(self, found: None, proof: str | None) -> Path:
        """The routers' file."""
        return self.workdir / ROUTERS_NAME

    def stopped_at(self) -> None:
        """None: the pass is a part of the merge, whose own Ctrl-C line says how to continue both."""
        return None


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
