"""The content proof of a pass's local models: the bytes the pass reads of each weight file, proved as a merge
proves its inputs (:mod:`resumerge.inputs.contents`), with the records kept beside the pass's journal.

A pass's folder is keyed by its models' identities (size, header, sampled blocks): enough to tell two models apart,
blind to a tensor re-drawn between two samples. So each local weight file's ranges the pass reads are recorded, an
xxh3-128 per *group* (the tensors of one decoder layer; those outside the layers are group -1), with how the file
looked (size, mtime, ctime, inode), in :data:`RECORDS_NAME` in the pass's folder, durably, before the pass's first
journal file. When the pass is asked again:

- a file that looks as recorded is trusted without reading a byte of it: a repeated ``check`` is answered from its
  report at the cost of a ``stat`` per file (writing, replacing or ``touch``-ing a file moves its ctime or its
  inode, which user space cannot set back);
- a file that looks different has its groups hashed again: the same digests (a ``touch``, a copy back, an edit in
  a range the pass never reads) are noted in one line and the new look recorded; a changed group the pass's journal
  already depends on (a layer it journaled, the figures it kept) refuses a resumed pass
  (:class:`~resumerge.errors.PlanChangedError`, exit 4, naming the file); a changed group it has not read yet is
  recorded anew and read as it is now, so the pass's result is that of the file as it is now.

Hub models are not here: their ranges are held to the hub's checksums (:mod:`resumerge.forward.opening.hubreads`).

May import: errors, inputs (looks, spans), store (durable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.errors import PlanChangedError, ResumergeError
from resumerge.forward.opening.opened import PassModel, layer_of
from resumerge.inputs.looks import Look, Spans, group_digests, look_of
from resumerge.inputs.spans import merged_spans
from resumerge.machine.durable import write_file_atomic

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.forward.job.journal import Journal

RECORDS_NAME = "inputs.json"
OUTSIDE = -1  # the group of the tensors outside the decoder layers
_VERSION = 1

# Whether a pass's journal depends on group ``group`` (a decoder layer, or OUTSIDE) of model ``model`` (its index).
Depends = Callable[[int, int], bool]
# Whether a pass reads stored tensor ``name`` of model ``model`` (its index).
Reads = Callable[[int, str], bool]


@dataclass(frozen=True)
class Proved:
    """What proving a pass's files found: ``changed``, the files one of whose groups holds other bytes than
    recorded (none of them a group the journal depends on: that raised), and ``same``, those touched that hold the
    bytes recorded in every range the pass reads."""

    changed: tuple[str, ...] = ()
    same: tuple[str, ...] = ()

    def line(self) -> str | None:
        """The one line a user reads about it (None: nothing to say)."""
        said = []
        if self.same:
            said.append(f"{_listed(self.same)} touched since last read, the same bytes in every range this pass "
                        "reads (an edit elsewhere changes nothing it finds)")
        if self.changed:
            said.append(f"{_listed(self.changed)} changed in ranges this pass had not read yet: read as they are "
                        "now")
        return "; ".join(said) or None


class PassProof:
    """The proof of the local weight files of ``models`` that the pass reads (``reads``: every stored tensor where
    None), recorded in ``records`` (a file beside the pass's journal; set once the pass's folder is known)."""

    def __init__(self, models: Sequence[PassModel], reads: Reads | None = None, records: Path | None = None) -> None:
        self.records = records if records is not None else Path(os.devnull)
        self._groups, self._model = pass_groups(models, reads)
        self._pending: dict[str, tuple[Look, dict[int, str]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._started: dict[str, Future[tuple[Look, dict[int, str]]]] = {}

    def start(self) -> None:
        """Begin hashing every file on threads of their own (the hash runs outside the GIL): where the pass will
        have to hash them anyway (a first check) while this process does something else first (loads its tokenizer,
        imports torch: seconds of one core). A hash taken early is as good as one taken later: it holds the
        file's look when hashed, checked before and after."""
        if self._pool is not None or not self._groups:
            return
        self._pool = ThreadPoolExecutor(min(len(self._groups), os.cpu_count() or 1, 8),
                                        thread_name_prefix="resumerge-proof")
        self._started = {p: self._pool.submit(group_digests, Path(p), self._groups[p]) for p in self._groups}

    def close(self) -> None:
        """Stop what :meth:`start` began and nothing used."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._started = None, {}

    @property
    def files(self) -> int:
        return len(self._groups)

    def prove(self, depends: Depends, *, refuse: str, hint: str) -> Proved:
        """Check every file against the records: raises :class:`PlanChangedError` (``refuse`` says what of the pass
        cannot be kept, ``hint`` what to do) naming the first file changed in a group ``depends`` says the journal
        holds; returns what else was found. What to record is kept for :meth:`record`."""
        recorded = self._read()
        looked: list[str] = []
        for path in self._groups:
            entry = recorded.get(path)
            if entry is None:
                continue
            try:
                now = look_of(Path(path))
            except FileNotFoundError:
                if any(depends(self._model[path], int(g)) for g in entry["groups"]):
                    raise PlanChangedError(f"input file {path} was deleted; {refuse}", path=path, hint=hint) from None
                continue
            if tuple(entry["look"]) != now:
                looked.append(path)
        # hashed again only because it was written just before it was hashed (its look not trusted): not touched
        racy = {p for p in looked if _racy(recorded[p]["look"], look_of(Path(p)))}
        same: list[str] = []
        changed: list[str] = []
        for path, (look, digests) in zip(looked, self._hashed(looked)):
            before = {int(g): d for g, d in recorded[path]["groups"].items()}
            moved = [g for g, d in digests.items() if before.get(g) != d]
            late = [g for g in moved if depends(self._model[path], g)]
            if late:
                where = "outside the decoder layers" if late[0] == OUTSIDE else f"in decoder layer {late[0]}"
                raise PlanChangedError(f"input file {path} holds other bytes {where} than when this pass read them; "
                                       f"{refuse}", path=path, hint=hint)
            if moved or path not in racy:
                (changed if moved else same).append(path)
            self._pending[path] = (look, digests)
        return Proved(tuple(changed), tuple(same))

    def record(self) -> None:
        """Record (durably) the digests of every file the records lack and the new look of those proved: before
        the pass's first journal file, so that what it journals is always covered."""
        recorded = self._read()
        missing = [p for p in self._groups if p not in recorded and p not in self._pending]
        for path, found in zip(missing, self._hashed(missing)):
            self._pending[path] = found
        if not self._pending:
            return
        for path, (look, digests) in self._pending.items():
            recorded[path] = {"look": list(look), "groups": {str(g): d for g, d in sorted(digests.items())}}
        self._pending = {}
        self.records.parent.mkdir(parents=True, exist_ok=True)
        doc = {"version": _VERSION, "algorithm": "xxh3-128", "files": recorded}
        write_file_atomic(self.records, (json.dumps(doc, sort_keys=True) + "\n").encode())

    def forget(self) -> None:
        """The records gone (the pass starts over: what it reads is recorded afresh)."""
        self.records.unlink(missing_ok=True)
        self._pending = {}

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            doc = json.loads(self.records.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        files = doc.get("files") if isinstance(doc, dict) and doc.get("version") == _VERSION else None
        return dict(files) if isinstance(files, dict) else {}

    def _hashed(self, paths: list[str]) -> list[tuple[Look, dict[int, str]]]:
        """Each file's look and group digests, hashed in parallel (most bytes first would not change the total on
        the few files a pass reads)."""
        if not paths:
            return []
        if self._started:
            found = {p: self._started.pop(p).result() for p in paths if p in self._started}
            rest = [p for p in paths if p not in found]
            if rest:
                found.update(zip(rest, self._hashed(rest)))
            return [found[p] for p in paths]
        workers = min(len(paths), os.cpu_count() or 1, 8)
        with ThreadPoolExecutor(workers, thread_name_prefix="resumerge-proof") as pool:
            return list(pool.map(lambda p: group_digests(Path(p), self._groups[p]), paths))


def _racy(recorded: Sequence[int], now: Look) -> bool:
    """Whether a file's look differs from the one recorded only in the ctime no stat matches (-1: hashed within a
    timestamp tick of its last write)."""
    return recorded[2] == -1 and (recorded[0], recorded[1], recorded[3]) == (now[0], now[1], now[3])


def pass_groups(models: Sequence[PassModel], reads: Reads | None = None
                ) -> tuple[dict[str, dict[int, Spans]], dict[str, int]]:
    """Per local weight file of ``models`` (by path) the spans of the stored tensors the pass reads
    (``reads``; every one where None), by group (decoder layer, or :data:`OUTSIDE`), and the index of the model
    it belongs to. A hub model's files are left to the hub's checksums."""
    groups: dict[str, dict[int, list[tuple[int, int]]]] = {}
    owner: dict[str, int] = {}
    for index, model in enumerate(models):
        if model.remote:
            continue
        for name, found in model.opened.tensors.items():
            if found.entry.end <= found.entry.start or (reads is not None and not reads(index, name)):
                continue
            path = os.fspath(Path(model.opened.directory) / found.file)
            layer = layer_of(name)
            groups.setdefault(path, {}).setdefault(OUTSIDE if layer is None else layer, []).append(
                (found.entry.start, found.entry.end))
            owner.setdefault(path, index)
    # a file not there is the reader's to name, in its own words, when the pass reads it
    present = {path: by for path, by in groups.items() if os.path.isfile(path)}
    return ({path: {g: tuple(merged_spans(spans)) for g, spans in sorted(by.items())} for path, by in present.items()},
            owner)


def layers_through(last: int | None, *, outside: bool) -> Depends:
    """A journal holding every layer through ``last`` (None: none) of every model, and what was found outside the
    decoder layers where ``outside``."""
    def depends(model: int, group: int) -> bool:
        if group == OUTSIDE:
            return outside or last is not None
        return last is not None and group <= last

    return depends


def everything(model: int, group: int) -> bool:
    """A finished pass depends on every byte it read."""
    return True


@dataclass(frozen=True)
class JournalProof:
    """The proof of a journaled pass whose journal is its layer files and whose result, once finished, is one file
    (eval's passes, evolve's generation pass), recorded beside the journal. ``models`` run the pass's own layers
    (the model evaluated, a KL task's parent: every stored tensor read; a journaled layer depends on their groups
    through it); ``inputs`` are the local models a merge never written reads (``inputs_read``: the tensors it reads
    of each, :func:`merge_inputs`), whose layers may feed any of the pass's: once a layer is journaled, every group
    read of them is depended on. ``what`` names the pass in a refusal; ``said`` gathers the lines a user reads (a
    file touched, an edit in ranges not read yet, a finished pass run again)."""

    models: Sequence[PassModel]
    what: str
    inputs: Sequence[PassModel] = ()
    inputs_read: Sequence[frozenset[str]] = ()
    said: list[str] = field(default_factory=list, compare=False)

    def before_resuming(self, journal: Journal) -> None:
        """Before the pass reads a weight (its embeddings too): refuses (:class:`PlanChangedError`, exit 4, the file
        and the layer named) where a file holds other bytes in a range the journal's layers were computed from;
        records the rest, durably, before the pass's next journal file."""
        found = journal.latest()
        last = None if found is None else found[0]
        through, own = layers_through(last, outside=False), len(self.models)

        def depends(model: int, group: int) -> bool:
            return through(model, group) if model < own else last is not None

        proof = self._proof(journal.folder / RECORDS_NAME)
        self._say(proof.prove(depends, refuse=f"{self.what}'s journal holds hidden states computed from the bytes "
                              "it held then", hint=f"restore the file as it was and run again (it resumes), or "
                              f"delete {journal.folder} to run the pass on the file as it is now").line())
        proof.record()

    def still_holds(self, result: Path) -> bool:
        """Whether the finished pass's ``result`` is of the bytes the models hold now (a stat per file where they
        look as recorded; a file touched hashed again, its new look recorded). False where a range the pass read
        holds other bytes: ``result`` and the records are removed, and the caller runs the pass again."""
        proof = self._proof(result.parent / RECORDS_NAME)
        try:
            proved = proof.prove(everything, refuse="", hint="")
        except PlanChangedError as exc:
            result.unlink(missing_ok=True)
            proof.forget()
            self._say(f"{exc.path} changed since {self.what} ran (in a range it reads): run again")
            return False
        self._say(proved.line())
        proof.record()
        return True

    def _proof(self, records: Path) -> PassProof:
        own, read = len(self.models), self.inputs_read

        def reads(model: int, name: str) -> bool:
            return model < own or name in read[model - own]

        return PassProof([*self.models, *self.inputs], reads, records)

    def _say(self, line: str | None) -> None:
        if line is not None:
            self.said.append(line)


def merge_inputs(plans: Sequence[Any], state: StateDir) -> tuple[list[PassModel], list[frozenset[str]]]:
    """The local input models of merges never written (``plans``: :class:`~resumerge.merge.plan.merge_plan.Plan` s over
    the same models, a generation's candidates or one config), opened (headers only) for a pass's proof, and the
    stored tensors the merges read of each (a companion part, a quantized tensor's scales, included); a folder a
    pass does not open as a model (a LoRA adapter's) is left to the plan's identity of its files."""
    from resumerge.forward.opening.opened import open_for_pass

    dirs: Mapping[str, str] = plans[0].model_dirs if plans else {}
    keys = [key for key, where in sorted(dirs.items()) if os.path.isdir(where)]
    read: dict[str, set[str]] = {key: set() for key in keys}
    for plan in plans:
        for tensor in plan.tensors.values():
            for ref in tensor.inputs:
                for each in (ref, *(part for _, part in ref.companions)):
                    if each.model in read:
                        read[each.model].add(each.tensor)
    models, names = [], []
    for key in keys:
        try:
            models.append(open_for_pass(dirs[key], f"model {key}", state))
        except ResumergeError:  # not a model a pass opens (a LoRA adapter's folder): left to the plan's identity
            continue
        names.append(frozenset(read[key]))
    return models, names


def _listed(paths: Sequence[str]) -> str:
    names = [os.fspath(p) for p in paths]
    return ", ".join(names) if len(names) <= 3 else f"{len(names)} input files ({names[0]} … {names[-1]})"


def compared_reads(models: Sequence[PassModel]) -> Reads:
    """What a check's static pass reads: every stored tensor of the merge (model 0), and of another model the tensors
    of the modules the merge holds (a tensor only another model holds is compared by no step, so an edit of it
    changes nothing the check finds); a model none of whose modules the merge holds by name (another naming) is
    read whole."""
    modules = {name.rpartition(".")[0] for name in models[0].opened.tensors} if models else set()
    whole = {i for i, m in enumerate(models)
             if not any(name.rpartition(".")[0] in modules for name in m.opened.tensors)}

    def reads(model: int, name: str) -> bool:
        return model == 0 or model in whole or name.rpartition(".")[0] in modules

    return reads
