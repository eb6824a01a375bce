"""Generation (``generate_until``) on a model that does not fit the memory budget: one decoder layer at a time for
every request of the task at once, a pass-driver client (:class:`GenerationJob`, run by
:func:`~resumerge.forward.job.driver.drive`). Each token step is one :class:`~resumerge.forward.job.layerpass.LayerPass`
over the decoder layers: a layer is read once and run on every unfinished request, each against its own KV cache at
that layer (:mod:`.kvcache`: held in RAM, or spilled to the pass's folder where the budget does not hold it), then
the final norm and the head give each request's next token (greedy, or drawn from the evaluation's torch seed:
:mod:`.genrequests`, each draw from a generator of its own, so the same as the whole model held draws). The first
step runs each context whole (transformers' prefill), one at a time as lm-eval's ``hf`` model does at its batch size
of one; every later one the newest tokens against the cache, as ``model.generate`` does, as one batch whose rows
compute bit for bit what each request computes alone (:mod:`.rowbatch`: the layer runs once a step, not once a
request, a family's batch checked against its rows on the first such step): the same calls to the family's own
layers, so the same tokens as lm-eval's ``hf`` model.

The journal is the token step's, not the layer's: a step's file (``step-<N>.safetensors``: the tokens it chose, the
positions it added to each request, and a held cache's new keys and values) is written durably once its tokens are
chosen, after a spilled cache's file is durable; a killed generation resumes at the first step not journaled, its
cache rebuilt from the files, and ends with the same answers. A layer's own file would cost an fsync per layer per
token. Where the whole model fits the budget, the whole model is held instead (:mod:`.generate`: the same answers,
greedy or sampled); :class:`Generation` decides which. A sampled request set's journal is keyed by the seed too
(:func:`generation_key`): another seed generates anew, the same seed resumes and answers from it."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resumerge.analyses.evaluation.genconfig import NONE, Processors, processors_of
from resumerge.analyses.evaluation.genplan import GenPlan, gen_plan
from resumerge.analyses.evaluation.genrequests import Wanted, model_defaults, samples, wanted_all
from resumerge.analyses.evaluation.kvcache import HeldKV, KVShape, KVStore, SpilledKV, one_layer_cache, shaped_cache
from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.status import PROGRESS_NAME
from resumerge.forward.engine.handed import HandingCall
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import Fit, PassFolder, drive
from resumerge.forward.job.journal import Journal, Restart, durable_save
from resumerge.forward.job.layerpass import LayerPass, Reserve, Step
from resumerge.forward.job.proof import RECORDS_NAME, JournalProof, PassProof, everything, layers_through
from resumerge.forward.opening.opened import PassModel
from resumerge.forward.text.batches import Hidden
from resumerge.machine.durable import write_file_atomic
from resumerge.machine.killpoints import reach
from resumerge.machine.torch_import import torch

GENERATED = "generated.json"  # the answers of a finished generation, as the lm-eval door's whole-model one keeps them
STEP_PREFIX = "step-"
# How a sampled token is drawn (genrequests' Wanted.choose), in a sampled journal's key: a journal of steps drawn
# another way (before repeats drew apart) is not resumed with these draws
_DRAWS = "draws-2"


def generation_key(requests: list[tuple[str, dict[str, Any]]], seed: int | None,
                   processors: Processors = NONE) -> str:
    """The key of a request set's generation (context, lm-eval's generation kwargs each): of the requests alone
    where none samples (the lm-eval door's whole-model key: either generation answers the other), of the requests
    and the torch ``seed`` where one does (another seed draws other answers), and the way it draws (``_DRAWS``);
    with the model's ``generation_config.json`` processors where it sets any (:meth:`~.genconfig.Processors.key`:
    a changed file generates anew)."""
    sampled = any(samples(kwargs) for _, kwargs in requests)
    doc: list[Any] = [requests, seed, _DRAWS] if sampled else requests
    if processors.key():
        doc = [doc, processors.key()]
    shown = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(shown.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class GenStep:
    """Where a generation is, for its watcher: token ``step`` of at most ``steps`` (None: not started), decoder
    ``layer`` (None: the head) of ``layers``, over ``requests`` unfinished; ``plan``: the estimate, said once before
    the first step."""

    requests: int
    step: int | None
    steps: int
    layer: int | None
    layers: int
    plan: str | None = None


@dataclass(frozen=True)
class Generation:
    """How an evaluation generates: its ``model`` (``weights``), under ``settings``' budget, journaled in
    ``folder_of(digest)`` (a request set's folder), continued by ``command``; ``fits_whole()``: whether the whole
    model fits the budget (then the generation holds it: :mod:`.generate`); ``watcher`` told each step;
    ``inputs``: a merge never written's inputs, proved with the journal as the model's own files are; ``said``:
    what proving found, a line each."""

    model: PassModel
    weights: Weights
    settings: EvalSettings
    folder_of: Callable[[str], Path]
    command: str
    fits_whole: Callable[[], bool]
    watcher: Callable[[GenStep], None] | None = None
    inputs: tuple[list[PassModel], list[frozenset[str]]] = ([], [])
    said: list[str] = field(default_factory=list, compare=False)

    def __call__(self, lm: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """The answers to ``requests`` (context, lm-eval's generation kwargs) of the lm-eval model ``lm``."""
        processors = self.processors()  # refused (exit 2) before any weight is read
        asked = wanted_all(lm, requests, self.seed, model_defaults(self.model.opened.directory), processors)
        if self.fits_whole():
            from resumerge.analyses.evaluation.generate import cached_stream, generate

            device = self.settings.pass_device().name
            with cached_stream(self.weights, self.model.opened.config, torch.float32, device) as whole:
                return generate(whole, lm, asked, self.seed)
        folder = self.folder_of(self.key(requests))
        hint = "wait for it to finish (run again, it answers from its journal), or stop it (it resumes at its step)"
        job = GenerationJob(PassFolder(folder, f"this generation of {self.model.path}", self.command, hint), self,
                            asked, lm.tokenizer)
        return drive(job)

    def processors(self) -> Processors:
        """What the model's ``generation_config.json`` does to each token step (:func:`~.genconfig.processors_of`:
        a setting not honoured refused, exit 2)."""
        return processors_of(self.model.opened.directory)

    def key(self, requests: list[tuple[str, dict[str, Any]]]) -> str:
        """The key of the generation of ``requests`` by this model (:func:`generation_key`)."""
        return generation_key(requests, self.seed, self.processors())

    @property
    def seed(self) -> int | None:
        """The seed a sampled request draws from: the evaluation's torch seed (lm-eval's ``--seed``'s third)."""
        return self.settings.seeds.torch


class _StepJournal(Journal):
    """A token step's layers, not journaled one by one: the step is, whole, once its tokens are chosen (a file per
    layer would cost an fsync per layer per token); a killed step runs again from its first layer."""

    def save(self, layer: int, hidden: list[list[torch.Tensor]], kept: Any = None,
             metadata: dict[str, str] | None = None) -> None:
        return None

    def restart(self, models: int, batches: int) -> Restart:
        return Restart()


@dataclass(frozen=True)
class _Ready:
    stream: ModelStream
    store: KVStore
    plan: GenPlan


@dataclass
class _Batching:
    """Whether a token step's newest tokens run through each layer as one batch (:mod:`.rowbatch`): None until a
    step compared the batch with its rows run alone, bit for bit, then what it found (False also where the calls
    cannot be one batch). One a generation run, the first step after the prefill deciding it."""

    exact: bool | None = None


# one request's output leaving a layer, and its keys and values there (its past and what the layer added)
_Ran = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]


class _TokenStep(Step["torch.Tensor"]):  # a string: torch is imported when a step runs
    """One token step over the layers: each layer read once (admitted as the step ``layer``), run on every
    unfinished request against its cache there (the newest tokens as one batch of rows, each computing what it
    computes alone: :mod:`.rowbatch`; the first step's contexts, of many lengths, one at a time, as lm-eval's
    ``hf`` model runs them); after the last, every request's next-token logits."""

    def __init__(self, ready: _Ready, active: list[int], calls: list[list[LayerCall]], shaped: list[Any],
                 added: list[int], reserve: Reserve, told: Callable[[int | None], None],
                 batching: _Batching) -> None:
        self.ready, self.active, self.calls, self.shaped, self.added = ready, active, calls, shaped, added
        self.reserve, self.told, self.batching = reserve, told, batching
        self.batched = (batching.exact is not False and len(active) > 1 and ready.plan.rows > 1
                        and all(a == 1 for a in added))

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        stream, store = self.ready.stream, self.ready.store
        self.told(index)
        module = stream.layers_list[index]
        with self.reserve(f"layer {index} of the generation", "layer"), stream.loaded(module) as layer:
            out: list[torch.Tensor] = []
            at_once = self.ready.plan.rows
            for first in range(0, len(self.active), at_once):  # as many requests at once as the plan holds
                rows = range(first, min(first + at_once, len(self.active)))
                for k, (found, keys, values) in zip(rows, self._rows(layer, index, hidden[0], rows)):
                    store.keep(index, self.active[k], keys, values, self.added[k])
                    out.append(found)
        return [out]

    def _rows(self, layer: torch.nn.Module, index: int, hidden: list[torch.Tensor], rows: range) -> list[_Ran]:
        """Rows ``rows`` run through ``layer``: as one batch where the step batches (the first such step's batch
        checked against the rows alone, bit for bit), else one at a time."""
        pasts = [self.ready.store.past(index, self.active[k]) for k in rows]
        ran = self._batch(layer, index, rows, [hidden[k] for k in rows], pasts) if self.batched else None
        if ran is None or self.batching.exact is None:
            alone = [self._alone(layer, index, k, hidden[k], past) for k, past in zip(rows, pasts)]
            if ran is not None and not all(all(torch.equal(a, b) for a, b in zip(one, other))
                                           for one, other in zip(ran, alone)):
                ran = None  # this family's batch rounds otherwise than its rows: one at a time from here
            if ran is None and self.batched:
                self.batched, self.batching.exact = False, False
            ran = alone if ran is None else ran
        return ran

    def _alone(self, layer: torch.nn.Module, index: int, k: int, hidden: torch.Tensor,
               past: tuple[torch.Tensor, torch.Tensor] | None) -> _Ran:
        """Row ``k`` run through ``layer`` alone against its cache."""
        cache = one_layer_cache(index, past, self.ready.stream.device)
        out = self.ready.stream.run(layer, hidden, _with_cache(self.calls[k][index], self.shaped[k], cache))
        kept = cache.layers[index]
        return out, kept.keys, kept.values

    def _batch(self, layer: torch.nn.Module, index: int, rows: range, hidden: list[torch.Tensor],
               pasts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> list[_Ran] | None:
        """Rows ``rows`` (entering as ``hidden``, their pasts ``pasts``) run through ``layer`` as one batch, each
        computing what it computes alone (None: the layer's calls cannot be one batch)."""
        from resumerge.analyses.evaluation.rowbatch import Rows, batched_call, implementation, padded, row_exact

        own = implementation(layer)
        held = [p for p in pasts if p is not None]
        if own is None or len(held) != len(pasts):
            return None
        keys, values, starts = padded(held)
        cache = one_layer_cache(index, (keys, values), self.ready.stream.device)
        calls = [self.calls[k][index] for k in rows]
        given = Rows(own, tuple(call[1].get("attention_mask") for call in calls), tuple(starts))
        call = batched_call(calls, [self.shaped[k] for k in rows], cache, given)
        if call is None:
            return None
        with row_exact(layer):
            out = self.ready.stream.run(layer, torch.cat(hidden), call)
        kept = cache.layers[index]
        return [(out[k:k + 1], kept.keys[k:k + 1, :, start:], kept.values[k:k + 1, :, start:])
                for k, start in enumerate(starts)]

    def finish(self, hidden: Hidden) -> torch.Tensor:
        self.told(None)
        if self.batched and self.batching.exact is None:
            self.batching.exact = True  # every layer's batch was its rows alone, bit for bit
        last = torch.cat([h[:, -1:, :] for h in hidden[0]])
        with self.reserve("the head of the generation", "heads"), self.ready.stream.head() as logits:
            found: torch.Tensor = logits(last)[:, -1, :]
        return found


def _with_cache(call: LayerCall, shaped: Any, cache: Any) -> LayerCall:
    """``call`` (captured with the stand-in ``shaped`` as the cache) with ``cache`` in its place."""
    args, kwargs = call
    made = (tuple(cache if a is shaped else a for a in args),
            {name: cache if value is shaped else value for name, value in kwargs.items()})
    return call.remade(made) if isinstance(call, HandingCall) else made


@dataclass(frozen=True)
class GenerationJob:
    """A generation as the pass driver runs it: its answers file is its answer cache, its steps the token steps."""

    folder: PassFolder
    how: Generation
    asked: list[Wanted]
    tokenizer: Any

    def _proof(self) -> JournalProof:
        return JournalProof([self.how.model], f"this generation of {self.how.model.path}", *self.how.inputs,
                            said=self.how.said)

    def answered(self) -> tuple[list[str] | None, str | None]:
        path = self.folder.path / GENERATED
        if path.is_file() and self._proof().still_holds(path):
            return [str(text) for text in json.loads(path.read_text(encoding="utf-8"))], None
        return None, None

    def proved(self) -> str | None:
        """Journaled token steps read every layer: a change in any byte the generation reads refuses it (exit 4)."""
        folder, how = self.folder.path, self.how
        journaled = next(folder.glob(f"{STEP_PREFIX}*.safetensors"), None) is not None
        own, read = 1, how.inputs[1]

        def reads(model: int, name: str) -> bool:
            return model < own or name in read[model - own]

        proof = PassProof([how.model, *how.inputs[0]], reads, folder / RECORDS_NAME)
        depends = everything if journaled else layers_through(None, outside=False)
        line = proof.prove(depends, refuse=f"this generation of {how.model.path}'s journal holds tokens computed from "
                           "the bytes it held then", hint=f"restore the file as it was and run again (it resumes), or "
                           f"delete {folder} to generate from the file as it is now").line()
        proof.record()
        return line

    @contextmanager
    def fitted(self) -> Iterator[Fit[_Ready]]:
        from resumerge.analyses.evaluation.generate import cached_stream

        how, folder = self.how, self.folder.path
        # on the evaluation's device (--device cuda: each layer there, the KV cache and the chosen tokens here)
        stream = cached_stream(how.weights, how.model.opened.config, torch.float32, how.settings.pass_device().name)
        store: KVStore | None = None
        try:
            shape = KVShape.of(stream.config, stream.layers)
            files = [how.model.opened.directory / f.name for f in how.model.opened.files]
            plan = gen_plan(stream, self.asked, shape, how.settings.max_memory, files)
            gpu = how.settings.pass_device().budget("the generation", plan.steps, plan.states)
            rooms = [len(w.tokens) + w.most for w in self.asked]
            store = HeldKV(shape) if plan.held else SpilledKV(folder, shape, rooms)
            self._say(GenStep(len(self.asked), None, plan.steps_most, None, stream.layers,
                              plan.line(len(self.asked), folder)))
            yield Fit(plan.budget, plan.steps, _Ready(stream, store, plan), gpu)
        finally:
            if store is not None:
                store.close(remove=False)
            stream.close()

    def run(self, ready: _Ready, reserve: Reserve) -> list[list[int]]:
        """Every token step not journaled yet, then each request's tokens."""
        folder, stream, store = self.folder.path, ready.stream, ready.store
        folder.mkdir(parents=True, exist_ok=True)
        journaled = self._journaled()
        store.restore(journaled)
        made: list[list[int]] = [[] for _ in self.asked]
        for tensors in journaled:
            for name, value in tensors.items():
                if name.startswith("token."):
                    made[int(name.split(".")[1])].append(int(value))
        step = len(journaled)
        batching = _Batching()
        while True:
            active = [r for r, w in enumerate(self.asked) if not w.done(self.tokenizer, made[r])]
            if not active:
                return made
            entered, shaped, added = self._entering(stream, active, made, step)

            def told(layer: int | None, step: int = step, active: int = len(active)) -> None:
                self._say(GenStep(active, step, ready.plan.steps_most, layer, stream.layers))

            token_step = _TokenStep(ready, active, [c for _, c in entered], shaped, added, reserve, told, batching)
            logits = LayerPass(_StepJournal(folder), stream.layers, "after_generation_layer", carries=None).run(
                token_step, [[h for h, _ in entered]], len(active))
            assert logits is not None  # the step never stops the pass
            tensors = store.step_done()  # a spilled cache durable before the step's file says it is
            for k, r in enumerate(active):
                token = self.asked[r].choose(logits[k], self.how.seed, made[r])
                made[r].append(token)
                tensors[f"token.{r}"] = torch.tensor(token)
                tensors[f"added.{r}"] = torch.tensor(added[k])
            durable_save(tensors, folder / f"{STEP_PREFIX}{step:05d}.safetensors")
            reach("after_generation_step")  # tests kill here: it resumes at the next step
            step += 1

    def _entering(self, stream: ModelStream, active: list[int], made: list[list[int]], step: int
                  ) -> tuple[list[tuple[torch.Tensor, list[LayerCall]]], list[Any], list[int]]:
        """Each unfinished request's hidden states entering the first layer this step (its whole context at the
        first step, its newest token after), every layer's call as the model's own forward makes it against a cache
        of its past (a stand-in: :func:`~.kvcache.shaped_cache`), that stand-in, and the positions it adds."""
        batches, shaped, added = [], [], []
        for r in active:
            want = self.asked[r]
            ids = list(want.tokens) if not made[r] else [made[r][-1]]
            past = 0 if not made[r] else len(want.tokens) + len(made[r]) - 1
            batches.append((torch.tensor([ids]), torch.ones(1, past + len(ids), dtype=torch.long)))
            shaped.append(shaped_cache(stream.config, past))
            added.append(len(ids))
        # the cache's name in this transformers' forward (``cache`` since 5.x, ``past_key_values`` before)
        name = "cache" if "cache" in inspect.signature(stream.inner.forward).parameters else "past_key_values"
        given = [{name: cache, "use_cache": True} for cache in shaped]
        with torch.no_grad():
            return stream.inputs_of_rows(batches, given=given), shaped, added

    def _journaled(self) -> list[dict[str, torch.Tensor]]:
        """Every journaled step's tensors, in order (a step file missing ends them: a later one is of no run)."""
        from safetensors.torch import load_file

        found: list[dict[str, torch.Tensor]] = []
        while (path := self.folder.path / f"{STEP_PREFIX}{len(found):05d}.safetensors").is_file():
            found.append(load_file(str(path)))
        return found

    def finish(self, found: list[list[int]], proof: str | None) -> list[str]:
        """The answers written (the answer cache), the step files and the spilled cache gone."""
        folder = self.folder.path
        answers = [w.answer(self.tokenizer, made) for w, made in zip(self.asked, found)]
        write_file_atomic(folder / GENERATED, json.dumps(answers).encode())
        for path in folder.glob(f"{STEP_PREFIX}*.safetensors*"):
            path.unlink(missing_ok=True)
        from resumerge.analyses.evaluation.kvcache import SPILL_NAME

        (folder / SPILL_NAME).unlink(missing_ok=True)
        self._progress(None, done=True)
        return answers

    def stopped_at(self) -> str:
        steps = len(list(self.folder.path.glob(f"{STEP_PREFIX}*.safetensors")))
        return (f"the generation of {self.how.model.path} was interrupted after {steps} token step(s) "
                f"({steps} journaled)")

    def _say(self, step: GenStep) -> None:
        # the progress file once a token step (its first layer) and at its head: written durably at every layer it
        # cost two fsyncs a layer, as much as a step's compute on a loaded disk; the watcher is told every layer
        if step.layer in (0, None):
            self._progress(step)
        if self.how.watcher is not None:
            self.how.watcher(step)

    def _progress(self, step: GenStep | None, done: bool = False) -> None:
        """The progress file ``status`` reads, as an evaluation's passes write it."""
        model = self.how.model
        doc = {"target": model.path, "model": model.path if model.remote else os.path.abspath(model.path),
               "tasks": list(self.how.settings.tasks), "pass": "generate_until", "requests": len(self.asked),
               "layer": None if step is None else step.layer, "layers": None if step is None else step.layers,
               "step": None if step is None else step.step, "pid": os.getpid(), "command": self.how.command,
               "done": done}
        self.folder.path.mkdir(parents=True, exist_ok=True)
        write_file_atomic(self.folder.path / PROGRESS_NAME, (json.dumps(doc) + "\n").encode())


def generated_by(generation: Generation, lm: Callable[[], Any]) -> Callable[[list[tuple[str, dict[str, Any]]]],
                                                                          list[str]]:
    """The generator an lm-eval model is given: ``generation`` of its requests, ``lm()`` the model asking."""
    def generated(requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
        return generation(lm(), requests)

    return generated

