"""The process's own baseline: the resident memory a fresh process of a command holds before it does any work.

``--max-memory`` counts the whole process (:class:`~resumerge.machine.memory.probe.SystemProbe`), so the smallest budget
a command can work under is that baseline (the interpreter, torch, the modules the command imports) plus its largest
step (:func:`~resumerge.machine.memory.budget.smallest_budget_for`). ``plan`` names that budget before the run's process
exists, and the run, ``check`` and ``measure`` name it again in theirs: for them to name the same figure, the
baseline is not read in whichever process asks (each holds a different mix of modules and objects, and two readings
of one process differ by a few hundred KB) but measured once in a fresh interpreter that imports exactly the
command's modules, and kept in a cache keyed by the installation (the interpreter, the modules and their
distributions' versions). A first measurement costs one import of torch (about 3 s of CPU); later ones read a file.

``check`` and ``measure`` hold, before their pass, what no fresh interpreter holds (transformers' modules imported
as the models need them, the tokenizer, the models' configs: 90 MB over a fresh import of torch and transformers
for a tiny Llama), so their baseline is their own process's reading; :func:`settled_reading` keeps the first
reading of a work (plus 1 %, what two starts differ by) so that ``measure --plan`` and ``measure``, or two starts
of one ``check``, name one figure.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

__all__ = ["SETTLE_FRACTION", "fresh_baseline", "measure_ahead", "resident_bytes", "settled_reading"]

_CACHE_NAME = "baseline.json"
# Two starts of one command read its process a few hundred KB apart (0.8 MB for measure on a tiny Llama, 343 MB):
# a named budget leaves this much of the reading more, so a rerun at the figure named is not refused again.
SETTLE_FRACTION = 0.01
# A measuring or compile-ahead child that gains no CPU time for this long is stuck, and killed (:func:`_stalled`); one
# that uses this many CPU seconds is too (the most a child was seen to need: 27 CPU s, the 7-type release's kernels
# compiled in one process). It is asked every _POLL_SECONDS.
_STALLED_SECONDS = 300.0
_CPU_CEILING = 900.0
_POLL_SECONDS = 2.0
# A fresh interpreter with this process's import path imports the modules (``module:function:argument``: the
# module's function called with the argument, work whose memory stays, as the loading of compiled kernels) and, after
# each count of them its stops name (the last: all of them), collects garbage and prints its RSS: one process
# measures a list and the lists it begins with (:func:`measure_ahead`), each reading taken as a fresh process that
# imported that list alone takes it. With ``wait`` ("1"), it reads a line from its stdin before its first call: it
# imports what comes before beside the work that call needs done first (:func:`_go`).
_MEASURE = ("import gc, importlib, json, sys\nsys.path[:] = json.loads(sys.argv[1])\n"
            "stops, wait = json.loads(sys.argv[2]), sys.argv[3] == '1'\n"
            "for at, name in enumerate(json.loads(sys.argv[4]), 1):\n    module, _, call = name.partition(':')\n"
            "    if call and wait:\n        sys.stdin.readline()\n        wait = False\n"
            "    found = importlib.import_module(module)\n    if call:\n"
            "        function, _, argument = call.partition(':')\n        getattr(found, function)(argument)\n"
            "    if at in stops:\n        gc.collect()\n"
            "        from resumerge.machine.memory.baseline import resident_bytes\n"
            "        print(resident_bytes(), flush=True)\n")


def resident_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """This process's resident set in bytes (``VmRSS``: anonymous, file-backed and shared pages, what the OS
    reports as its RSS), None where ``status`` cannot be read (not Linux)."""
    try:
        text = status.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def fresh_baseline(modules: Sequence[str], cache_dir: Path) -> int | None:
    """The RSS of a fresh process of this interpreter once it has imported ``modules`` (in order; an entry
    ``module:function:argument`` calls that function too, :data:`_MEASURE`), from the cache
    in ``cache_dir`` or measured now in a child process (and cached); None when it cannot be measured (no
    interpreter to start, a module that fails to import there): the caller then reads its own process."""
    key = _key(modules)
    path = cache_dir / _CACHE_NAME
    cached = _read(path).get(key)
    if cached is not None:
        return cached
    measured = _measure(modules)
    if measured is not None:
        _keep(path, lambda kept: {**kept, key: measured})
    return measured


def measure_ahead(each: Sequence[Sequence[str]], cache_dir: Path, prepare: Sequence[Sequence[str]] = ()) -> None:
    """Measure the baselines of ``each`` (module lists, as :func:`fresh_baseline` takes them) not in the cache yet,
    in fresh processes started together, and cache them, so that the :func:`fresh_baseline` calls that follow read
    them: a run that needs several (its importance pass's, the merge's after it) waits for one import of torch's
    wall, not one each after another. A list that begins another (the run's modules and the importance pass's
    after them, then the kernels the merge after it loads) is measured by that one's process as it gets there
    (:func:`_chains`): what it reads then is what a fresh process importing that list alone reads, and the longer
    list's import of torch is its own. One missing, or none, is left to :func:`fresh_baseline`; a list that cannot
    be measured here is measured there again (and falls back as it says).

    ``prepare``: lists run first, in fresh processes of their own started together (their figures not kept), where
    a missing list makes a call (a ``module:function:argument`` entry): work each such measurement would otherwise
    do again, as the compilation of numba's kernels into its disk cache that the first load of each makes (the
    7-type release's kernels: 27 CPU s, made by both of its lists with them). The lists making no call start beside
    them (a process whose first list makes none, up to its first call); those making one after them, each then
    loading what they made (and measuring what a run that loads it holds, not a compiler's leftovers)."""
    path = cache_dir / _CACHE_NAME
    cached = _read(path)
    missing = {_key(modules): tuple(modules) for modules in each if _key(modules) not in cached}
    if len(missing) < 2:
        return
    chains = _chains(missing)
    calling = [_calls(modules) for modules, _ in chains]
    preparing = [_start(modules) for modules in prepare] if any(calling) else []
    # a chain that calls waits for what prepare makes; one whose first list makes no call starts beside prepare,
    # and is told to go on to its call once prepare is done
    waiting = [bool(preparing) and calls and not _calls(modules[:min(stops.values())])
               for (modules, stops), calls in zip(chains, calling)]
    started = {at: _start(modules, stops.values(), wait=waits) for at, ((modules, stops), calls, waits)
               in enumerate(zip(chains, calling, waiting)) if waits or not calls or not preparing}
    for child in preparing:
        _finish(child)
    for at in started:
        if waiting[at]:
            _go(started[at])
    started.update({at: _start(modules, stops.values()) for at, (modules, stops) in enumerate(chains)
                    if at not in started})
    measured: dict[str, int] = {}
    for at, child in started.items():
        stops = chains[at][1]
        figures = _figures(child, len(set(stops.values())))
        if figures is not None:
            by_stop = dict(zip(sorted(set(stops.values())), figures))
            measured.update({key: by_stop[stop] for key, stop in stops.items()})
    if measured:
        _keep(path, lambda kept: {**kept, **measured})


def _chains(missing: dict[str, tuple[str, ...]]) -> list[tuple[tuple[str, ...], dict[str, int]]]:
    """``missing``'s lists (by key) as the processes that measure them: a list that begins another (the run's
    modules, and the run's with the importance pass's after them) is measured by the longer one's process as it
    reaches the list's end (each list's count of modules, by key), one import of torch for both. In the order
    given; a list joins the first process whose list it begins or which begins it."""
    chains: list[tuple[tuple[str, ...], dict[str, int]]] = []
    for key, modules in missing.items():
        for at, (head, stops) in enumerate(chains):
            if head[:len(modules)] == modules or modules[:len(head)] == head:
                chains[at] = (max(head, modules, key=len), {**stops, key: len(modules)})
                break
        else:
            chains.append((modules, {key: len(modules)}))
    return chains


def _calls(modules: Sequence[str]) -> bool:
    """Whether ``modules`` holds a call (a ``module:function:argument`` entry)."""
    return any(":" in m for m in modules)


def settled_reading(work: Sequence[str], reading: int, cache_dir: Path) -> int:
    """What a process doing ``work`` (the command and what sets its process's memory: its models, its texts) holds
    before it, as every start of that work names it: the first ``reading`` of it on this installation plus
    :data:`SETTLE_FRACTION` of it, kept in the cache in ``cache_dir``; a later reading within that is given the
    kept figure, a higher one (the process really holds more) replaces it. Where the cache cannot be written, this
    reading plus the fraction."""
    key = "held:" + hashlib.sha256(json.dumps([_key(("torch", "transformers")), *work]).encode()).hexdigest()[:32]
    settled = reading + int(reading * SETTLE_FRACTION)
    named = settled

    def settle(kept: dict[str, int]) -> dict[str, int] | None:
        nonlocal named
        found = kept.get(key)
        if found is not None and reading <= found:  # read under the lock: two starts together name one figure
            named = found
            return None
        return {**kept, key: settled}

    path = cache_dir / _CACHE_NAME
    found = _read(path).get(key)
    if found is not None and reading <= found:
        return found
    _keep(path, settle)
    return named


def _key(modules: Sequence[str]) -> str:
    """What the baseline depends on: the interpreter, where resumerge is imported from, the modules and the
    versions of the distributions they come from (not the working directory: ``plan`` and ``run`` started from two
    folders read one figure)."""
    tops = tuple(sorted({m.split(".")[0].split(":")[0] for m in modules}))
    return _installed_key(tuple(modules), tops, tuple(sys.path))


@functools.cache
def _installed_key(modules: tuple[str, ...], tops: tuple[str, ...], path: tuple[str, ...]) -> str:
    """:func:`_key`'s figure, once per process for one module list and one ``sys.path`` (``path``: a changed import
    path may find other distributions, so it is part of the cache's key): the distributions' metadata is read once,
    not at every run's start."""
    del path  # in the cache's key only: importlib.metadata reads sys.path itself
    versions: dict[str, str | None] = {}
    for top in tops:
        try:
            versions[top] = importlib.metadata.version(top)
        except importlib.metadata.PackageNotFoundError:
            versions[top] = None
    where = str(Path(__file__).resolve().parents[1])
    text = json.dumps([sys.executable, sys.version, where, list(modules), versions])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _measure(modules: Sequence[str]) -> int | None:
    return _finish(_start(modules))


def _start(modules: Sequence[str], stops: Iterable[int] = (), *, wait: bool = False) -> subprocess.Popen[str] | None:
    """The fresh process measuring ``modules`` (:data:`_MEASURE`), started; None where none can be. ``stops``: the
    counts of its first modules after which it reads its RSS too (the lists that begin ``modules``); ``wait``: it
    waits for :func:`_go` before its first call."""
    if not sys.executable:
        return None
    counts = sorted({*stops, len(modules)})
    try:
        return subprocess.Popen([sys.executable, "-c", _MEASURE, json.dumps(sys.path), json.dumps(counts),
                                 "1" if wait else "0", json.dumps(list(modules))],
                                stdin=subprocess.PIPE if wait else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def _go(child: subprocess.Popen[str] | None) -> None:
    """Let ``child`` (started with ``wait``) go on to its first call; one that ended meanwhile reads nothing (its
    figures are read as it left them)."""
    if child is None or child.stdin is None:
        return
    with contextlib.suppress(OSError):
        child.stdin.write("\n")
        child.stdin.flush()


def _finish(child: subprocess.Popen[str] | None) -> int | None:
    """What ``child`` (:func:`_start`) printed as its RSS, once it ended; None where it failed, or stalled (then
    killed: :func:`_stalled`)."""
    figures = _figures(child, 1)
    return None if figures is None else figures[-1]


def _figures(child: subprocess.Popen[str] | None, count: int) -> list[int] | None:
    """The ``count`` RSS readings ``child`` (:func:`_start`) printed last, once it ended; None where it failed, or
    stalled (then killed: :func:`_stalled`)."""
    if child is None:
        return None
    gained, since = _cpu_seconds(child.pid), time.monotonic()
    while True:
        try:
            out, _ = child.communicate(timeout=_POLL_SECONDS)
            break
        except subprocess.TimeoutExpired:
            used = _cpu_seconds(child.pid)
            if used is not None and (gained is None or used > gained):
                gained, since = used, time.monotonic()
            if _stalled(used, time.monotonic() - since):
                child.kill()
                child.communicate()
                return None
    lines = out.split()[-count:]
    if child.returncode != 0 or len(lines) < count or not all(line.isdigit() for line in lines):
        return None
    return [int(line) for line in lines]


def _stalled(used: float | None, idle: float) -> bool:
    """Whether a child that used ``used`` CPU seconds (None: unknown) and gained none for ``idle`` seconds is stuck:
    it gained none for :data:`_STALLED_SECONDS` (a hung import, a stopped process), or it ran past
    :data:`_CPU_CEILING` CPU seconds. Its wall time alone kills none: on a loaded machine a compile-ahead child
    (numba compiling a release's kernels, 27 CPU s alone) ran past the 300 s a child had, was killed, and each
    measurement after it compiled them again, or its figure fell back to one without the kernels; where the CPU
    time cannot be read (no ``/proc``), it gains none, so :data:`_STALLED_SECONDS` of wall time kill it, as before."""
    return idle > _STALLED_SECONDS or (used is not None and used > _CPU_CEILING)


def _cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user and system) process ``pid`` has used, from ``/proc``; None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace").rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _read(path: Path) -> dict[str, int]:
    """The figures the cache at ``path`` holds: of a file that is not this cache's (torn, another program's, other
    JSON), nothing; of its entries, those this module writes (a key to a positive whole number of bytes: not a bool,
    a float or a string), the others dropped, never trusted."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {key: value for key, value in loaded.items() if type(value) is int and value > 0}


def _keep(path: Path, change: Callable[[dict[str, int]], dict[str, int] | None]) -> None:
    """The cache at ``path`` read, given to ``change`` and written as it answers (None: left as it is), under an
    exclusive lock on the file beside it (:func:`_locked`), so two processes keeping figures together keep both
    (each read what the other wrote), where before the second's write dropped the first's entry (measured again
    at a later start: a fresh interpreter importing torch, 4 to 27 CPU s). A cache: where it cannot be written (a
    read-only folder, a full disk), nothing is kept and the figure is measured again at a later start."""
    with contextlib.suppress(OSError), _locked(path):
        changed = change(_read(path))
        if changed is not None:
            _write(path, changed)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path``'s lock file (``baseline.json.lock``: the cache itself is replaced by each
    write, so no lock on it lasts), held for one read and write of the small file; it vanishes with the process,
    so a process killed holding it leaves nothing to clear. Readers take no lock: each write is a whole new file
    renamed over the old (:func:`_write`), so a reader sees one or the other, never part of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def _write(path: Path, figures: dict[str, int]) -> None:
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{_CACHE_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(figures, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
