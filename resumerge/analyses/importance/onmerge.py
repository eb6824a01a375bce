"""The importance matrix computed on a merge never written (``run --out-type gguf --imatrix-texts FILE``), as the
forward driver runs a pass (:func:`resumerge.forward.job.driver.drive`): the merge read as the model it describes
(:class:`~resumerge.merge.engine.unwritten.UnwrittenMerge`: each tensor merged by ``run``'s code when read, dropped
after), the texts run through it one decoder layer at a time (:mod:`.sums`), the sums journaled with the hidden
states under the state dir, and the matrix written last as llama-imatrix writes it
(:mod:`resumerge.forward.sums.imatrix`), with the content key that made it beside it: the run's encoding reads it there,
and a run killed anywhere after finds it.

Its folder and answer are keyed by the merge's float plan, the tokens and the code's versions (a changed input or
texts file: another key, computed again); each layer is admitted by the RAM governor under the run's budget."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.importance.ahead import ahead_fits, reading_ahead
from resumerge.analyses.importance.sums import Found
from resumerge.forward.job.driver import Fit, PassFolder, content_key, drive
from resumerge.forward.job.layerpass import Reserve
from resumerge.forward.sums.imatrix import imatrix_file, named_entries, write_imatrix
from resumerge.machine.threadcount import THREADS_FILE
from resumerge.merge.engine.unwritten import layer_of

if TYPE_CHECKING:
    from resumerge.forward.engine.stream import ModelStream
    from resumerge.machine.torch_import import torch
    from resumerge.merge.engine.unwritten import UnwrittenMerge

KEY_SUFFIX = ".key"  # beside the matrix: the content key of the pass that wrote it
COSTS_SUFFIX = ".costs.json"  # beside it too, where the pass measured costs (--gguf-target-size)


def costs_path(out: Path) -> Path:
    """Where the pass writing the matrix ``out`` writes the costs it measured."""
    return out.with_name(out.stem + COSTS_SUFFIX)


@dataclass(frozen=True)
class ImportanceReport:
    """A computed importance matrix: where it is, the ``texts`` and ``tokens`` it summed, its ``entries`` (weights)
    and whether it was there already (``reused``)."""

    path: str
    texts: int
    tokens: int
    entries: int
    reused: bool


@dataclass(frozen=True)
class PassTerms:
    """How an importance pass runs: ``dataset``, the matrix file's ``imatrix.datasets``; ``max_memory``, the budget
    (None: the default), refused (exit 2) before any weight is read where a layer would not fit; ``command``, what
    continues it (a second process is told it); ``judged``: the run's phase judged the budget already, by
    ``plan``'s figures (else judged here, by the process's reading); ``costs``: each linear's cost at every
    candidate GGUF type measured in the same pass, written beside the matrix (:func:`costs_path`: JSON, by GGUF
    name then type name)."""

    dataset: str
    max_memory: int | None
    command: str
    judged: bool = False
    costs: bool = False


def importance_on_merge(merge: UnwrittenMerge, arch: str, tokens: list[list[int]], out: Path, terms: PassTerms,
                        on_progress: Callable[[int, int], None] | None = None) -> ImportanceReport:
    """The importance matrix of ``merge`` (its weights named as an ``arch`` GGUF names them) over ``tokens`` (one
    sequence a text), written to ``out`` (llama-imatrix's GGUF), journaled in a folder beside it, run on ``terms``;
    answered without a read where ``out`` holds this very pass's matrix. ``on_progress(done, layers)``: told each
    time a layer's sums are durable (and the layers a resumed pass found journaled)."""
    import torch

    from resumerge.outputs.gguf.sensitivity import K_CANDIDATES, LEGACY_CANDIDATES

    versions = [importlib.metadata.version(d) for d in ("transformers", "resumerge")] + [torch.__version__]
    # the costs' candidate types are the journal's: a pass measured among others is measured again
    costing = ["costs by output error", list(K_CANDIDATES), list(LEGACY_CANDIDATES)] if terms.costs else []
    key = content_key([merge.plan.fingerprint, tokens, versions, *costing])
    folder = out.with_suffix("")
    # the thread count beside the journal, removed with it: the folder is the config's and the texts' (another
    # merge of them, its inputs changed, passes there too, and decides its own count)
    where = PassFolder(folder, f"the importance matrix pass into {out}", terms.command,
                       hint="wait for it to finish, or stop it (run again, it resumes at the layer it reached)",
                       threads=folder / key[:32] / THREADS_FILE)
    return drive(_ImportanceJob(where, merge, arch, tokens, out, key, terms, on_progress))


def _layer_bytes(stream: ModelStream) -> int:
    """The most a decoder layer of ``stream`` holds: its float32 values, each the output of its merge."""
    from resumerge.forward.engine.reader import pass_bytes

    return pass_bytes(stream.formats, stream.layers, value_bytes=4, in_place=lambda name: True)


def states_bytes(tokens: int, hidden: int) -> int:
    """The hidden states the pass holds over ``tokens`` tokens of width ``hidden``: those entering a layer and those
    leaving it, float32."""
    return 2 * tokens * hidden * 4


def pass_held(step: int, tokens: int, hidden: int) -> int:
    """What the pass holds beyond its process's baseline at its peak: its largest ``step`` (a layer's values and
    a tensor's merge) beside the hidden states (:func:`states_bytes`); the figure its guard judges and ``plan``
    names."""
    return states_bytes(tokens, hidden) + step


def texts_held(shapes: Iterable[tuple[str, Sequence[int]]], lengths: Sequence[int], hidden: int, *,
               measuring: bool = False) -> int:
    """What the pass holds beyond :func:`pass_held`'s step while a layer runs its texts, of the merge's tensors'
    ``shapes`` (name, shape: those of the decoder layers counted) over texts of ``lengths`` tokens (in order) of
    width ``hidden``: the products of the texts running at once (two where both are short,
    :func:`~resumerge.analyses.importance.sums.tokens_at_once`), per token three of the widest matrix's (a gate's,
    an up projection's and theirs), the float64 copy of its input the sums' hook squares and a few of the layer's
    width; ``measuring`` (a size target's), or, once they ran, its matrices' costs measured
    (:func:`~resumerge.outputs.gguf.sensitivity.measuring_bytes`). Counted in the step ``plan`` names
    (:func:`resumerge.api.importance.importance_cost`), the pass admits and its layers reserve: a layer whose MLP
    is 16,416 wide (of 64 columns) ran 8 texts of 480 tokens to 739 MB at the 477 MB ``plan`` named without them."""
    from resumerge.analyses.importance.sums import rerun_tokens, tokens_at_once
    from resumerge.outputs.gguf.sensitivity import measuring_bytes

    layers: dict[int, list[Sequence[int]]] = {}
    for name, shape in shapes:
        index = layer_of(name)
        if index is not None:
            layers.setdefault(index, []).append(shape)
    widest = max((int(d) for each in layers.values() for s in each if len(s) >= 2 for d in s[-2:]), default=0)
    products = tokens_at_once(lengths) * (20 * widest + 24 * hidden)
    if not measuring:
        return products
    return max(products, measuring_bytes(layers.values(), rerun_tokens(lengths), max(lengths, default=0), hidden))


@dataclass(frozen=True)
class _ImportanceJob:
    """The pass as the driver runs it (:class:`~resumerge.forward.job.driver.PassJob`)."""

    folder: PassFolder
    merge: UnwrittenMerge
    arch: str
    tokens: list[list[int]]
    out: Path
    key: str
    terms: PassTerms
    on_progress: Callable[[int, int], None] | None

    @property
    def _journal_dir(self) -> Path:
        return self.folder.path / self.key[:32]

    def answered(self) -> tuple[ImportanceReport | None, str | None]:
        """The matrix ``out`` holds, where this very pass wrote it."""
        keyed = self.out.with_name(self.out.name + KEY_SUFFIX)
        if not (self.out.is_file() and keyed.is_file() and keyed.read_text(encoding="utf-8").strip() == self.key):
            return None, None
        if self.terms.costs and not costs_path(self.out).is_file():
            return None, None
        return self._report(reused=True), None

    def proved(self) -> str | None:
        """Nothing beyond the key: it holds the merge's plan, whose inputs the run proves before it writes."""
        return None

    @contextmanager
    def fitted(self) -> Iterator[Fit[ModelStream]]:
        """The merge's modules built without weights and its layer step judged against the budget (refused, exit 2,
        before any weight is read); where the run's phase judged it already (``judged``: by ``plan``'s figures,
        before anything was written), the budget in force, unjudged again (the texts' tokens of GGUF inputs, which
        ``plan`` counts by their bytes, would make two refusals of one budget)."""
        from resumerge.forward.engine.reader import Weights
        from resumerge.forward.engine.stream import ModelStream
        from resumerge.machine.memory import SystemProbe, budget_fitting, default_budget
        from resumerge.machine.torch_import import torch

        merge = self.merge
        stream = ModelStream(Weights.of(merge.directory, merge.tensors, source=merge.source), merge.config,
                             torch.float32, what="resumerge run --imatrix-texts", key="merge")
        try:
            hidden = int(getattr(stream.config, "hidden_size", 0) or 0)
            step, _ = self._step(stream)
            step += texts_held(((n, tp.shape) for n, tp in merge.plan.tensors.items()),
                               [len(t) for t in self.tokens], hidden, measuring=self.terms.costs)
            if self.terms.judged:
                budget = self.terms.max_memory if self.terms.max_memory is not None else default_budget(SystemProbe())
            else:
                held = pass_held(step, sum(len(t) for t in self.tokens), hidden)
                budget = budget_fitting("the importance matrix pass over the merge", held, self.terms.max_memory,
                                        SystemProbe())
            yield Fit(budget, {"layer": step}, stream)
        finally:
            stream.close()

    def run(self, stream: ModelStream, reserve: Reserve) -> Found:
        """The texts through every layer, the sums journaled per layer (:class:`~.sums.SumStep`)."""
        from resumerge.analyses.importance.sums import SumStep
        from resumerge.forward.engine.handed import Held
        from resumerge.forward.job.journal import Journal
        from resumerge.forward.job.layerpass import LayerPass
        from resumerge.forward.text.batches import one_by_one
        from resumerge.machine.torch_import import torch

        batches = one_by_one(self.tokens)  # each text alone: every position summed, no padding
        with torch.no_grad():
            # Of the input embeddings, the rows the texts use, merged alone where that is exact: the whole table
            # was merged for them (a 49,152-row table, about 1.5 of a 2-layer bench merge's pass's 6 CPU s, and its
            # float32 copy held).
            entering = stream.inputs_of_rows(batches)
        calls = [c for _, c in entering]
        layers = stream.layers

        def saved(index: int) -> None:
            if self.on_progress is not None:
                self.on_progress(index + 1, layers)

        journal = Journal(self._journal_dir, "layer-", hidden="hidden.{s}")
        # The next layer merged while one runs, where the step the fit judged holds it (its ahead module).
        with reading_ahead(stream, self._step(stream)[1]) as ahead:
            step = SumStep(stream, calls, reserve, ahead=ahead, costs=self.terms.costs)
            # kill point after_imatrix_layer: a layer's sums and hidden states durable
            # (resumerge.machine.killpoints)
            found = LayerPass(journal, layers, point="after_imatrix_layer", carries=Held(lambda: [calls]),
                              on_saved=saved).run(step, [[h for h, _ in entering]], len(batches))
        assert found is not None  # the step never stops the pass
        return found

    def _step(self, stream: ModelStream) -> tuple[int, bool]:
        """The pass's largest step and whether it reads a layer ahead: each step's float32 values and the largest
        merge of its own tensors (the embeddings' of the rows the texts use, where they merge alone:
        :func:`~resumerge.forward.compared.needs.merged_steps`), and where the room a whole table's merge would take
        holds a layer read ahead (:func:`~resumerge.analyses.importance.ahead.ahead_fits`, as before), that layer's step
        beside it. What ``plan`` names of it is :func:`resumerge.api.importance.importance_cost`'s, from the plan
        alone."""
        from resumerge.forward.compared.needs import merged_steps

        merge = self.merge
        steps = list(merged_steps(stream, merge, self.tokens).values())  # the embeddings', then each layer's
        largest = max((merge.tensor_merge_bytes(name) or 0 for name in merge.plan.tensors
                       if layer_of(name) is not None), default=0)
        ahead = ahead_fits(_layer_bytes(stream), largest, merge.merge_bytes)
        return max(steps, default=0) + (max(steps[1:], default=0) if ahead else 0), ahead

    def finish(self, found: Found, proof: str | None) -> ImportanceReport:
        """The matrix written (and the costs), then its key beside it (each durable), then the journal removed."""
        import shutil

        from resumerge.machine.durable import write_file_atomic

        tokens = sum(len(t) for t in self.tokens)
        sums, counts, costs = found
        entries = named_entries(self.arch, {name: s.numpy() for name, s in sums.items()}, tokens,
                                {name: c.numpy() for name, c in counts.items()})
        if self.terms.costs:
            write_file_atomic(costs_path(self.out), costs_json(self.arch, costs, bool(counts)))
        write_imatrix(self.out, imatrix_file(entries, self.terms.dataset, len(self.tokens)))
        write_file_atomic(self.out.with_name(self.out.name + KEY_SUFFIX), (self.key + "\n").encode())
        shutil.rmtree(self._journal_dir, ignore_errors=True)
        return self._report(reused=False, entries=len(entries))

    def stopped_at(self) -> str:
        return ("the importance matrix pass over the merge was interrupted (its journal is kept: run again, it "
                "resumes at the layer it reached)")

    def _report(self, *, reused: bool, entries: int | None = None) -> ImportanceReport:
        if entries is None:
            from resumerge.outputs.gguf.imatrix import read_imatrix

            entries = len(read_imatrix(self.out))
        return ImportanceReport(os.fspath(self.out), len(self.tokens), sum(len(t) for t in self.tokens), entries,
                                reused)


def costs_json(arch: str, costs: dict[str, torch.Tensor], experts: bool) -> bytes:
    """The costs the pass measured (by checkpoint module name: a row of candidate types over a row of costs) as the
    file beside the matrix: by GGUF weight name, each type's name and cost (JSON floats round-trip exactly)."""
    import json

    from resumerge.inputs.gguf.ggmltypes import TYPES
    from resumerge.inputs.gguf.names import gguf_name

    named: dict[str, dict[str, float]] = {}
    for linear, values in costs.items():  # [types; costs]
        name = gguf_name(arch, f"{linear}.weight", experts=experts)
        if name is None:
            continue
        types, found = values.tolist()
        named[name] = {TYPES[int(t)].name: float(c) for t, c in zip(types, found, strict=True)}
    return (json.dumps(named, sort_keys=True, indent=0) + "\n").encode()
