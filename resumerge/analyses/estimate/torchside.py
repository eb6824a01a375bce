"""Where ``plan``'s work that needs torch runs: in this process, or in a helper process started before planning.

``resumerge plan`` needs torch for one thing only, the speed sample (:mod:`resumerge.analyses.estimate.compute`),
and reports how long a run's import of torch takes. Importing torch costs about 3 s of CPU; planning a large merge
(headers, plan, fingerprint) is single-threaded Python that needs none of it. :class:`TorchProcess` starts a
helper process before planning: it imports torch (timing that import: the figure ``plan`` reports) while this
process plans on another core. Where the run's workers fill torch's threads on the CPU (two workers on two cores)
the sample times one thread by its CPU time, which work beside it does not change: it is then sent to the helper as
soon as the plan is built (:meth:`TorchProcess.submit`) and measured there while this process estimates the rest
(output, downloads, memory, disks). Elsewhere it is timed by the wall clock on torch's threads, so it is sent once
this process has nothing left to do but wait for it (see :mod:`resumerge.analyses.estimate.compute`): either way the
figures stay what a run's process alone would measure. The helper reads the sample's rows itself and hands back
only the figures. :class:`TorchHere` does the same work in this
process (a notebook's, where torch is usually loaded already), the sample when its result is asked for.

Both are context managers: leaving the block (a plan refused with exit 2 included) kills the helper at once, even
in the middle of its import, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import copyreg
import importlib
import io
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType, TracebackType
from typing import Any, Generic, Protocol, TypeVar

import psutil

from resumerge.config.closing import Closing
from resumerge.machine.torch_import import load as load_torch
from resumerge.machine.torch_import import loaded as torch_loaded
from resumerge.machine.torch_import import torch
from resumerge.merge.engine.devices import set_torch_threads

__all__ = ["TorchFacts", "TorchHere", "TorchProcess", "TorchSide", "serve"]

T = TypeVar("T")

# The helper's command: the same import path as this process's (so it runs this very resumerge, whatever the
# working directory holds), then serve(threads).
_SERVE = ("import json, sys\nsys.path[:] = json.loads(sys.argv[1])\n"
          "from resumerge.analyses.estimate.torchside import serve\nserve(int(sys.argv[2]) or None)\n")
# Modules torch imports that a planning process holds before its own import would (see serve).
_SHARED = ("numpy", "asyncio", "email.message", "concurrent.futures")
# How the helper answers a call: its result, the exception it raised, or "run it yourself".
_DONE, _RAISED, _HERE = "done", "raised", "here"


@dataclass(frozen=True)
class TorchFacts:
    """What importing torch cost where the calls run, and what it set there: ``import_seconds`` (0 when it was
    imported before), the anonymous bytes (as a memory budget counts them) and resident bytes (its mapped libraries
    too) it added to that process that this one's own readings do not hold (0 when the calls run here),
    torch's thread count, and ``helper_bytes``: all the anonymous bytes the helper process holds (its interpreter
    and torch), which this machine's available memory lacks until it ends (0 when the calls run here)."""

    import_seconds: float
    anon_bytes: int
    rss_bytes: int
    threads: int
    helper_bytes: int = 0


class TorchSide(Protocol):
    """Runs calls that need torch, and says what importing torch took where they run."""

    def facts(self) -> TorchFacts:
        """What the import of torch took where the calls run (it is imported by then)."""

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, run where torch is; raises what ``fn`` raises."""

    def submit(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        """``fn(*args)`` started where torch is; what it returns gives its result (or raises what ``fn`` raised),
        waiting for it if need be. A side in this process runs it then."""


class TorchHere:
    """The calls in this process; torch is imported here when :meth:`import_seconds` or a call first needs it."""

    def __init__(self) -> None:
        self._facts: TorchFacts | None = None

    def __enter__(self) -> TorchHere:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        return None

    def facts(self) -> TorchFacts:
        """Imports torch now if it is not yet (the sample needs it next), timing that import; this process's own
        memory readings hold what it added."""
        if self._facts is None:
            already = torch_loaded()
            started = time.perf_counter()
            load_torch()
            seconds = 0.0 if already else time.perf_counter() - started
            self._facts = TorchFacts(seconds, 0, 0, _threads())
        return self._facts

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def submit(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        """Runs nothing yet: ``fn`` runs in this process when its result is asked for, with nothing beside it."""
        return partial(fn, *args)


class TorchProcess(Closing):
    """A helper process that imports torch at once, with ``threads`` torch threads (None: torch's choice, as a
    fresh run's process gets), then runs the calls sent to it, one at a time, and hands back their results.
    Calls and results travel pickled (functions by name), so a call's arguments must be small: send a sample's
    plan, not a whole plan. If the helper cannot be started or dies, the calls run in this process instead
    (:class:`TorchHere`)."""

    def __init__(self, threads: int | None) -> None:
        self._here = TorchHere()
        self._facts: TorchFacts | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._owed: _Reply[Any] | None = None  # the call sent whose answer is not read yet
        if not sys.executable:  # an embedded interpreter that cannot name itself: the calls run here
            return
        try:
            # A session of its own: a Ctrl-C at the terminal reaches this process, which then kills the helper.
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, json.dumps(sys.path), str(threads or 0)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        except OSError:
            self._process = None

    def close(self) -> None:
        """Kill the helper (it holds nothing to finish) and reap it."""
        process, self._process = self._process, None
        if process is None:
            return
        process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()

    def facts(self) -> TorchFacts:
        """The helper's import, measured there: it takes what a fresh run's process will take."""
        if self._facts is None:
            answer = self._receive()
            self._facts = answer if isinstance(answer, TorchFacts) else self._here.facts()
        return self._facts

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self.submit(fn, *args)()

    def submit(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        """Sends ``fn(*args)`` to the helper now: it runs there while this process goes on. The helper answers its
        calls in order, so a later call (or asking for this one's result) reads this one's answer first. Runs in
        this process instead, when its result is asked for, where the helper is gone or the call cannot travel."""
        self.facts()  # the helper's first message
        self._settle()
        here = partial(self._here.call, fn, *args)
        process = self._process
        if process is None or process.stdin is None:
            return here
        try:
            request = _pickled((fn, args))
        except (pickle.PicklingError, TypeError, AttributeError):  # a lambda, say: then it runs here
            return here
        try:
            process.stdin.write(request)
            process.stdin.flush()
        except OSError:
            self.close()
            return here
        reply: _Reply[T] = _Reply(here, self._settle)
        self._owed = reply
        return reply

    def _settle(self) -> None:
        """Read the answer the helper owes (the call sent last, if its answer was not read yet)."""
        owed, self._owed = self._owed, None
        if owed is not None:
            owed.answer, owed.read = self._receive(), True

    def _receive(self) -> Any:
        """The helper's next message; None (and the helper closed) when it died or never started, or its message
        cannot be read (unpickling can raise almost anything: a class whose ``__init__`` it cannot call, say)."""
        process = self._process
        if process is None or process.stdout is None:
            return None
        try:
            return pickle.load(process.stdout)
        except Exception:  # the helper is of no more use: the calls run here
            self.close()
            return None


class _Reply(Generic[T]):
    """The result of a call sent to the helper: its ``answer`` (None when the helper died), read by ``settle`` (the
    sender's, which reads the answer it owes) when first wanted; ``here`` runs the call in this process."""

    def __init__(self, here: Callable[[], T], settle: Callable[[], None]) -> None:
        self.here, self._settle = here, settle
        self.answer: Any = None
        self.read = False

    def __call__(self) -> T:
        if not self.read:
            self._settle()
        if self.answer is None:
            return self.here()
        how, value = self.answer
        if how == _RAISED:
            raise value
        if how == _HERE:  # its result could not travel back
            return self.here()
        result: T = value
        return result


def serve(threads: int | None) -> None:
    """The helper's main: set ``threads``, import torch, send its :class:`TorchFacts`, then answer each pickled
    ``(function, args)`` read from stdin with ``(_DONE, result)``, ``(_RAISED, exception)`` or, when that cannot
    be pickled (or an exception cannot be unpickled: one whose ``__init__`` takes keyword-only arguments, say),
    ``(_HERE, None)`` (the caller then runs the call itself, and gets the real exception), until stdin ends."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    requests = sys.stdin.buffer
    set_torch_threads(threads)
    # What torch imports that the planning process holds already (numpy, the packages the hub client pulls in) is
    # imported first, so that what the import adds here is what it would add there: within 3.5 MB of a planning
    # process's own reading with torch, where importing all of the estimate's modules first (exact) costs 0.6 s of CPU.
    for name in _SHARED:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    process = psutil.Process()
    anon, rss = _anonymous(process), int(process.memory_info().rss)
    started = time.perf_counter()
    load_torch()
    seconds = time.perf_counter() - started
    held = _anonymous(process)
    facts = TorchFacts(seconds, max(0, held - anon), max(0, int(process.memory_info().rss) - rss), _threads(), held)
    try:
        pickle.dump(facts, reply)
        reply.flush()
        while True:
            try:
                fn, args = pickle.load(requests)
            except EOFError:
                return
            try:
                answer: tuple[str, Any] = (_DONE, fn(*args))
            except Exception as exc:  # handed back to the caller, which raises it
                answer = (_RAISED, exc)
            try:
                payload = _pickled(answer)
                if answer[0] == _RAISED:  # it must be made again there: an exception's pickle often cannot
                    pickle.loads(payload)
            except Exception:  # whatever fails to pickle: the caller can run the call itself
                payload = pickle.dumps((_HERE, None))
            reply.write(payload)
            reply.flush()
    except BrokenPipeError:  # the caller is gone
        return


def _anonymous(process: psutil.Process) -> int:
    """``process``'s resident memory less its file-backed pages: what its end gives back to the machine (the
    mapped libraries stay in the page cache)."""
    info = process.memory_info()
    return int(info.rss) - int(getattr(info, "shared", 0))


def _threads() -> int:
    return int(torch.get_num_threads())


def _pickled(value: Any) -> bytes:
    """``value`` pickled, read-only mappings (a method's declared tables) as the dicts they show."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, MappingProxyType: _proxy}
    pickler.dump(value)
    return buffer.getvalue()


def _proxy(mapping: MappingProxyType[Any, Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return _read_only, (dict(mapping),)


def _read_only(mapping: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(mapping)
