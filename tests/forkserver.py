"""A fork server for the suite's ``python -m resumerge`` processes (:func:`support.cli`): one interpreter per test
worker imports torch, numpy, safetensors and the third-party modules a command imports that read no environment
once (about 2.3 s of CPU each time otherwise) and forks a child for each
command. The child is a real process of its own — its own pid, environment, working directory, stdout and stderr
files, exit status; a kill test's SIGKILL kills it — that runs ``python -m resumerge ARGS`` as a fresh interpreter
would: the resumerge modules a local run imports are imported in the server (none reads the environment as it is
imported), and everything that reads the environment as it is imported (huggingface_hub, transformers) is imported in
the child, never in the server. The commands that import transformers (eval, check, evolve) are forked from a second
server that also imported what transformers imports but transformers and the hub client (torch's dynamo, sympy,
scipy), having recorded the run-time variables those imports read: a command whose values differ starts fresh.

Only what cannot differ between commands is imported before the fork; a command whose environment changes what those
imports read (the interpreter's or torch's threads, preloaded libraries, another ``PYTHONPATH``) gets a fresh
interpreter instead (:func:`forkable`). A command under an ``LD_PRELOAD`` library that exports
``void forkserver_child(void)`` (the fault shim, tests/faultshim) is forked from a server of its own started under that
library: each child calls the function once its environment is the command's, and the library reads its settings
again, as at a process's start. A library without it is never forked from (its server ends at once: a fresh
interpreter runs each such command).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import MappingProxyType
from typing import Any

# What the server imports before it forks: none of them reads an environment variable the tests vary. Past torch and
# the formats, the third-party modules a hub command imports through the hub client (trio, httpcore2; a local run
# imports none of them), a run's ledger (sqlite_utils, click), its progress (rich) and its locks (psutil,
# filelock): 0.79 → 0.48 CPU s for a forked tiny `run` (five pairs, load 5-8). Not huggingface_hub, transformers nor
# tqdm: their constants are read from the environment as they are imported. A module not installed is not preloaded.
# resumerge's own modules that a local run or resume imports (about 250 of them: a forked tiny run 0.95 -> 0.33 CPU s,
# a resume 0.7 -> 0.15, bench/suite_fork_cpu.py), none of which reads the environment as it is imported (the house
# rule: no module-level mutable state), nor imports a module that does (the server refuses to start if one did:
# _NEVER_BEFORE_FORK). A command that imports others (the hub client, check, eval) imports them in the child as before.
_RESUMERGE = ("resumerge.cli.commands", "resumerge.cli.render", "resumerge.cli.statusshow", "resumerge.api.calls",
              "resumerge.api.merge_kind", "resumerge.api.recipe_kind", "resumerge.merge.engine.session",
              "resumerge.merge.engine.executors", "resumerge.merge.engine.drive", "resumerge.merge.methods.builtin",
              "resumerge.runs.recipes.recipe", "resumerge.merge.store.journal_commit", "resumerge.machine.runlock",
              "resumerge.merge.store.integrity")
# Read the environment as they are imported: never imported before the fork (see _RUNTIME).
_NEVER_BEFORE_FORK = ("huggingface_hub", "transformers")
_PRELOAD = ("torch", "numpy", "safetensors", "safetensors.torch", "yaml", "trio", "anyio", "httpx2", "httpcore2", "h11",
            "rich.console", "rich.text", "sqlite_utils", "click", "psutil", "filelock", "attr", "dill",
            *_RESUMERGE)
# What the server of the commands that import transformers (:data:`TRANSFORMERS_COMMANDS`) imports besides: the
# modules transformers' modeling_utils, core_model_loading and lm-eval import that are not transformers',
# huggingface_hub's nor another that reads HF_HOME as it is imported (accelerate, datasets): torch's dynamo, DTensor and
# FSDP modules, sympy, scipy's optimize and linalg (about 2 of the 3.5 CPU s such a child spent importing). Whatever
# run-time variable (_RUNTIME) one of them reads as it is imported (torch._dynamo: TORCHINDUCTOR_CACHE_DIR) is
# recorded by the server: a command whose value differs starts a fresh interpreter (:meth:`ForkServer.unforkable`).
_TRANSFORMERS_PRELOAD = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
                         "torch.distributed._composable.fsdp", "torch.fx.experimental.symbolic_shapes", "sympy",
                         "scipy.optimize", "scipy.linalg")
# The commands forked from that server (the first argument of :func:`support.cli`): each imports transformers.
TRANSFORMERS_COMMANDS = frozenset({"eval", "check", "evolve"})
# Environment variables a command may set or change and still be forked: read at run time by resumerge, the hub
# client and transformers (imported in the child), never by the preloaded modules. TORCHINDUCTOR_CACHE_DIR is set
# in the test process by torch._dynamo's import (a transformers model run in the test, PEFT's import) and read only
# when a cache directory is asked for (torch._inductor, never imported by the server): left out, every command after
# such a test started a fresh interpreter (torch imported again) for the rest of the worker's session.
# FAULTSHIM_ is the fault shim's, which each child has read them again (forkserver_child). PYTHONBREAKPOINT is read
# by breakpoint() as it is called, never at an interpreter's start; Ray's driver sets it as it connects
# (ray._private.worker.connect), so left out, every command after a Ray test of the worker (those run first) started a
# fresh interpreter for the rest of its session.
# WANDB_ and TRACKIO_ are read by wandb and trackio, which only a command imports (evolve --wandb/--trackio, eval's
# lm-eval logging), never the server: the tracking tests' commands were fresh interpreters for them alone.
_RUNTIME = re.compile(r"(RESUMERGE_|HF_|HUGGINGFACE_|XDG_|PYTEST_|TRANSFORMERS_|TOKENIZERS_|RAY_|NO_COLOR$|"
                      r"COLUMNS$|LINES$|TERM$|HOME$|TORCHINDUCTOR_CACHE_DIR$|FAULTSHIM_|PYTHONBREAKPOINT$|WANDB_|"
                      r"TRACKIO_)")
# The environment every test starts with, where it is not one of the variables above: the process's as this module is
# imported (tests/conftest.py imports it first, before any test module or library, so nothing a library sets as it is
# imported is in it), but for PYTHONDONTWRITEBYTECODE, which conftest's ``bytecode_kept`` takes out for the session.
# conftest's ``hermetic`` puts these back before each test; a worker's fork server starts with them whatever the test
# that first needs it has set (see :func:`worker_server`).
SESSION_ENV = MappingProxyType({name: value for name, value in os.environ.items()
                                if not _RUNTIME.match(name) and name != "PYTHONDONTWRITEBYTECODE"})


def session_environment() -> None:
    """Put every variable that is not a run-time one (``_RUNTIME``) back as the session started
    (:data:`SESSION_ENV`): what a library set in this process (wandb's ``WANDB_SERVICE`` as it starts its service,
    scikit-learn's ``KMP_*``, Ray's ``PYTHONBREAKPOINT``) or a test left set. Left set, every later command of the
    worker differed from its fork server's environment and started a fresh interpreter instead (torch imported again,
    2-5 CPU s each) for the rest of the session, from whichever test the worker ran first that set one."""
    for name in [n for n in os.environ if not _RUNTIME.match(n) and n not in SESSION_ENV]:
        del os.environ[name]
    for name, value in SESSION_ENV.items():
        if os.environ.get(name) != value:
            os.environ[name] = value

_SERVER = r"""
import json, os, runpy, sys
# OpenMP reads its wait policy once, as torch loads it: sleeping threads between kernels, as resumerge's check sets
# it in its own process before torch's import (resumerge.analyses.check.run); for the other commands it changes no
# result, only how idle threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
preload, never, runtime = json.loads(sys.argv[1])
# The run-time variables (a command may differ there) the preloaded modules read as they were imported, with the value
# each had, and those they set: the test worker forks a command only where its own agree (ForkServer.unforkable). A
# look-up by name, not a walk over every variable (tqdm's, for its TQDM_ ones, as it is imported).
import re
runtime, environ_class, read = re.compile(runtime), type(os.environ), {}
before = dict(os.environ)
def _recorded(method):
    def reading(self, name, *rest):
        walk = sys._getframe(1).f_code.co_name == "__iter__"
        if isinstance(name, str) and runtime.match(name) and name not in read and not walk:
            read[name] = before.get(name)
        return method(self, name, *rest)
    return reading
getitem, contains = environ_class.__getitem__, environ_class.__contains__
environ_class.__getitem__, environ_class.__contains__ = _recorded(getitem), _recorded(contains)
for name in preload:
    try:
        __import__(name)
    except ImportError:
        pass
environ_class.__getitem__, environ_class.__contains__ = getitem, contains
imported_set = {name: value for name, value in os.environ.items() if before.get(name) != value}
if read_as_imported := sorted(set(never) & set(sys.modules)):
    sys.exit(f"the fork server's preload imported {read_as_imported}, which read the environment as they are imported")
if len(sys.argv) > 2:  # started under an LD_PRELOAD library: its children make it read their settings
    import ctypes
    child_hook = ctypes.CDLL(sys.argv[2]).forkserver_child  # none: this server ends, each command runs fresh
requests, replies = sys.stdin, sys.stdout
# What this server holds imported, by the folder each top-level module came from (None: none, or not one folder): a
# command whose PYTHONPATH adds folders holding none of them, or the same ones, may be forked
def _folder(module):
    path = getattr(module, "__file__", None)
    if not path:
        return None
    folder = os.path.dirname(os.path.realpath(path))
    return os.path.dirname(folder) if os.path.basename(path).startswith("__init__.") else folder
replies.write(json.dumps({"modules": {name: _folder(sys.modules[name]) for name in list(sys.modules)
                                      if "." not in name}, "read": read, "set": imported_set}) + "\n")
replies.flush()
while True:
    line = requests.readline()
    if not line:  # the test worker is done: nothing to tear down (torch's teardown took seconds under load)
        os._exit(0)
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
    replies.write(json.dumps({"status": code}) + "\n")
    replies.flush()
    # Reaped once the test has read its status, as a Popen's child is by its wait: until then its pid stays its own (a
    # zombie), so a signal the test sends it after it ended cannot reach another process that took its number.
    requests.readline()
    os.waitpid(pid, 0)
    replies.write(json.dumps({"reaped": pid}) + "\n")
    replies.flush()
# The child: a process as `python -m resumerge ARGS` starts it, but for the imports above (the server never touched
# a signal's handling: SIGINT raises KeyboardInterrupt, SIGPIPE is ignored, as in any interpreter).
os.chdir(job["cwd"])
os.environ.clear()
os.environ.update(job["env"])
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # what the CLI's main sets before torch's first import
for name, value in imported_set.items():  # what the preloaded imports set (the worker forks only a command whose
    os.environ.setdefault(name, value)  # value is unset or that one): a fresh interpreter's imports set it so
if len(sys.argv) > 2:
    child_hook()  # the preloaded library's settings, from this environment (set above: putenv reaches C's getenv)
if job.get("limits"):  # as a launcher sets them before it execs the command
    import resource
    for limit, value in job["limits"].items():
        resource.setrlimit(getattr(resource, limit), (value, value))
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(target, fd)
    os.close(target)
os.close(null)
sys.stdin = sys.__stdin__ = open(0, closefd=False)  # the server's may hold read-ahead of the requests
if job.get("script"):  # `python SCRIPT ARGS`: the script's folder first on the path, as the interpreter puts it
    sys.path[0] = os.path.dirname(job["script"])
    sys.argv = [job["script"], *job["args"]]
else:
    sys.path[0] = os.getcwd()
    sys.argv = ["resumerge", *job["args"]]
# The folders the command's PYTHONPATH puts before the server's, where a fresh interpreter puts them: after the
# script's folder or the working directory (an empty entry is the working directory).
sys.path[1:1] = [os.path.abspath(folder) if folder else os.getcwd() for folder in job["path_added"]]
if job.get("script"):
    runpy.run_path(job["script"], run_name="__main__")
else:
    runpy.run_module("resumerge", run_name="__main__", alter_sys=True)
"""


class ForkServer:
    """The server process of one test worker, started at its first command."""

    reply_seconds = 60.0  # how long a request's first reply (the forked child's pid) may take
    # Once the server has said (its first reply): the run-time variables its imports read, with their values then,
    # and the variables its imports set.
    _read_env: MappingProxyType[str, str | None] = MappingProxyType({})
    _set_env: MappingProxyType[str, str] = MappingProxyType({})

    def __init__(self, preload: str | None = None, env: dict[str, str] | None = None,
                 transformers: bool = False) -> None:
        """``preload``: the ``LD_PRELOAD`` library the server and its children run under (module docstring);
        ``env``: the server's environment (None: this process's); ``transformers``: the server of the commands that
        import transformers (:data:`TRANSFORMERS_COMMANDS`), which imports :data:`_TRANSFORMERS_PRELOAD` too."""
        self.env = dict(os.environ if env is None else env)
        if preload is not None:
            self.env["LD_PRELOAD"] = preload
        modules = (*_PRELOAD, *_TRANSFORMERS_PRELOAD) if transformers else _PRELOAD
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps([modules, _NEVER_BEFORE_FORK, _RUNTIME.pattern]),
             *([preload] if preload else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, text=True, bufsize=1)
        self._read = b""  # replies read but not yet taken
        self._modules: dict[str, str | None] | None = None  # what the server imported, once it has said
        self._said = threading.Lock()
        self._busy = threading.Lock()  # one command at a time: a second one at once gets a fresh interpreter
        self._running: Forked | None = None  # the command started last, until its status is read
        self.folder = Path(tempfile.mkdtemp(prefix="resumerge-forkserver-"))

    def forkable(self, env: dict[str, str]) -> bool:
        """Whether a command with environment ``env`` may be forked: it differs from the server's only where the
        preloaded modules never look, or in a ``PYTHONPATH`` that puts folders before the server's holding none of
        the modules the server imported but those it imported from there (a test's stand-in for a package the
        command imports itself: a transformers that fails to import)."""
        return self.unforkable(env) is None

    def unforkable(self, env: dict[str, str]) -> str | None:
        """Why a command with environment ``env`` starts a fresh interpreter (:meth:`forkable`), None where it may be
        forked: the suite's fork log (RESUMERGE_TEST_FORKLOG, :func:`support.cli`) counts these."""
        if self.process.poll() is not None:
            return "server ended" + (" (LD_PRELOAD without forkserver_child)" if "LD_PRELOAD" in self.env else "")
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        if read_at_start := sorted(k for k in changed - {"PYTHONPATH"} if not _RUNTIME.match(k)):
            return "env " + ",".join(read_at_start)
        self._imported()
        if read_at_import := sorted(k for k, v in self._read_env.items()
                                    if env.get(k) not in {v, self._set_env.get(k, v)}):
            return "env read at import " + ",".join(read_at_import)
        return None if self.path_added(env) is not None else "PYTHONPATH"

    def path_added(self, env: dict[str, str]) -> list[str] | None:
        """The entries ``env``'s PYTHONPATH puts before the server's (``[]``: the same); None where it differs
        otherwise, where one of those is not a folder, or where one holds a module the server imported from
        elsewhere (the command would import that one: the repository's root, which holds the resumerge the server
        imported, may come first)."""
        new, old = (e.get("PYTHONPATH", "") for e in (env, self.env))
        new_entries, old_entries = (value.split(os.pathsep) if value else [] for value in (new, old))
        cut = len(new_entries) - len(old_entries)
        if cut < 0 or new_entries[cut:] != old_entries:
            return None
        added = new_entries[:cut]
        imported = self._imported()
        for folder in added:
            where = Path(folder or ".").absolute()
            if not where.is_dir():  # a zip archive is not looked into (nor a folder not there: a test's mistake)
                return None
            there = os.path.realpath(where)
            if any(imported.get(name, there) != there for name in {e.name.partition(".")[0] for e in where.iterdir()}):
                return None
        return added

    def _imported(self) -> dict[str, str | None]:
        """The top-level modules the server imported, each with the folder it came from (its first reply, read
        once)."""
        with self._said:
            if self._modules is None:
                said = self._reply(120)
                self._read_env, self._set_env = (MappingProxyType(said.get("read", {})),
                                                    MappingProxyType(said.get("set", {})))
                self._modules = dict(said["modules"])
            return self._modules

    def run(self, args: list[str], env: dict[str, str], timeout: float, script: Path | None = None,
            limits: dict[str, int] | None = None) -> subprocess.CompletedProcess[str] | None:
        """``python -m resumerge ARGS`` (or ``python SCRIPT ARGS``) in a child forked from the server, as
        :func:`subprocess.run` returns it; None while another command runs there (the server runs one at a time: the
        caller starts a fresh one)."""
        child = self.start(args, env, capture=True, script=script, limits=limits)
        if child is None:
            return None
        try:
            out, err = child.communicate(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(30)
            raise
        return subprocess.CompletedProcess(child.args, child.wait(), out, err)

    def start(self, args: list[str], env: dict[str, str], *, capture: bool, script: Path | None = None,
              limits: dict[str, int] | None = None) -> Forked | None:
        """``python -m resumerge ARGS`` (or, given ``script``, ``python SCRIPT ARGS``: a test's own front end to the
        CLI) started in a child forked from the server, under the resource ``limits`` (``{"RLIMIT_FSIZE": bytes}``:
        soft and hard, set before the command starts), returned at once; its stdout and stderr kept for
        :meth:`Forked.communicate` where ``capture``, else sent to /dev/null. None while another command runs there
        (the server runs one at a time: the caller starts a fresh one)."""
        if not self._busy.acquire(blocking=False):
            return None
        asked = False
        try:
            out, err = ((self.folder / "stdout", self.folder / "stderr") if capture else
                        (Path(os.devnull), Path(os.devnull)))
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "stdout": str(out),
                                                 "stderr": str(err), "script": script and str(script),
                                                 "limits": limits or {}, "path_added": self.path_added(env) or []})
                                     + "\n")
            self.process.stdin.flush()
            asked = True
            pid = int(self._reply(self.reply_seconds)["pid"])
        except BaseException:
            if asked:  # its reply may still come, and be read as the next command's: ended, worker_server starts
                self.process.kill()  # another (the command, if it was forked, runs on alone)
            self._busy.release()
            raise
        command = [sys.executable, *([str(script)] if script else ["-m", "resumerge"]), *args]
        self._running = Forked(self, command, pid, (out, err) if capture else None)
        return self._running

    def settle(self) -> list[str] | None:
        """Kill (SIGKILL) and reap the command a test left running, or ended but unread (a :class:`Forked` it never
        waited for); its argv, None where there was none. Until its status is read the server stays busy, and every
        command of every later test of the worker would start a fresh interpreter (conftest's ``hermetic`` calls
        this as each test ends)."""
        running = self._running
        if running is None or running.returncode is not None:
            return None
        running.kill()
        running.wait(60)
        return running.args

    def _status(self, timeout: float | None) -> int:
        """The exit status of the command the server runs, waiting at most ``timeout`` seconds (None: as long as it
        takes); the command is left unreaped (:meth:`_reap`)."""
        return int(self._reply(timeout)["status"])

    def _reap(self) -> None:
        """Let the server reap the command whose status was read; it is free for the next one after."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write("{}\n")
            self.process.stdin.flush()
            self._reply(60)
        finally:
            self._running = None
            self._busy.release()

    def _reply(self, timeout: float | None) -> dict[str, Any]:
        """The server's next reply line, waiting at most ``timeout`` seconds for it."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()  # read raw: a buffered reader would hide a line already come from select
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._read:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired("resumerge", timeout or 0)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the fork server ended")
            self._read += chunk
        line, self._read = self._read.split(b"\n", 1)
        return dict(json.loads(line))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        for name in ("stdout", "stderr"):
            (self.folder / name).unlink(missing_ok=True)
        if self.folder.exists():  # closed once by the session's end, once more at the interpreter's exit
            self.folder.rmdir()


def servers() -> list[ForkServer]:
    """This worker's servers now."""
    return list(_SERVERS.values())


def close_servers() -> None:
    """Close this worker's servers (conftest's ``pytest_unconfigure``: an xdist worker ends without running its
    ``atexit`` functions, which left each server's folder in the temp dir)."""
    for server in _SERVERS.values():
        server.close()


def settle_servers() -> None:
    """:meth:`ForkServer.settle` for each of this worker's servers."""
    for server in _SERVERS.values():
        server.settle()


def server_environment() -> dict[str, str]:
    """The environment a worker's fork server starts with: the session's (:data:`SESSION_ENV`) and this moment's
    run-time variables, not what the test that first needs it set (its ``OMP_NUM_THREADS``, its ``PYTHONPATH``):
    started with those, every command of every later test, which has them not, started a fresh interpreter."""
    return {**{k: v for k, v in os.environ.items() if _RUNTIME.match(k)}, **SESSION_ENV}


# this worker's fork servers, each started by its first command, by LD_PRELOAD library (None: none) and whether it
# is the server of the commands that import transformers
_SERVERS: dict[tuple[str | None, bool], ForkServer] = {}
# How this worker's CLI commands started (:func:`tally`): "forked", or why a fresh interpreter ran each instead; and
# "server restarted" for each server that ended and was started again. conftest's summary prints the run's.
TALLY: Counter[str] = Counter()


def tally(why: str | None) -> None:
    """Count one command of :func:`support.cli` or :func:`support.cli_start`: forked (``why`` None) or fresh."""
    TALLY["forked" if why is None else why] += 1


def worker_server(preload: str | None = None, transformers: bool = False) -> ForkServer:
    """This worker's fork server for commands under the ``LD_PRELOAD`` library ``preload`` (None: none), the one that
    imports what transformers imports too where ``transformers`` (:data:`TRANSFORMERS_COMMANDS`): one,
    though the test modules import the helpers both as ``support`` and as ``tests.support`` (two modules, which each
    kept a server of their own: two interpreters importing torch). A server that ended once it had started (said what
    it imported: killed by a test or the kernel's OOM killer, or by :meth:`ForkServer.start` for a reply that came too
    late to trust the next one) is started again: kept, every later command of the worker's session started a fresh
    interpreter ("server ended"). One that ended as it started (an ``LD_PRELOAD`` library without
    ``forkserver_child``, which ends its server at once) stays ended: its commands start fresh ones."""
    key = (preload, transformers)
    ended = _SERVERS.get(key)
    if ended is not None and ended._modules is not None and ended.process.poll() is not None:
        ended.close()
        del _SERVERS[key]
        TALLY["server restarted"] += 1
    if key not in _SERVERS:
        _SERVERS[key] = ForkServer(preload, server_environment(), transformers)
        atexit.register(_SERVERS[key].close)
    return _SERVERS[key]


class Forked:
    """A command started by :meth:`ForkServer.start`, with the part of :class:`subprocess.Popen` the tests use: its
    ``pid`` (a signal sent to it reaches the command: the server reaps it only once its status is read),
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate`` and ``communicate``, text mode.
    Its output is read when it has ended, never as it comes."""

    def __init__(self, server: ForkServer, args: list[str], pid: int, files: tuple[Path, Path] | None) -> None:
        self.server, self.args, self.pid, self.files = server, args, pid, files
        self.returncode: int | None = None
        self._reading = threading.Lock()  # a hub thread may poll while the test waits

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        if not self._reading.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            if self.returncode is None:
                self.returncode = self.server._status(timeout)  # set first: no signal is sent to it after
                self.server._reap()
            return self.returncode
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        finally:
            self._reading.release()

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        self.wait(timeout)
        if self.files is None:
            return None, None
        return self.files[0].read_text(), self.files[1].read_text()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()
