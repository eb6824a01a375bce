"""Helpers for tests that drive the real CLI in subprocesses."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import xxhash
import yaml
from forkserver import TRANSFORMERS_COMMANDS, Forked, tally, worker_server

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model

MANIFEST = "resumerge-manifest.json"  # OUT's manifest (resumerge.merge.store.manifest.MANIFEST_NAME)


def _command(script: Path | None) -> list[str]:
    return [sys.executable, *([str(script)] if script else ["-m", "resumerge"])]


def cli(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 120,
        fresh: bool = False, script: Path | None = None,
        limits: dict[str, int] | None = None, transformers: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``python -m resumerge ARGS`` (or ``python SCRIPT ARGS``, a test's own front end to the CLI) in a process
    of its own, under the resource ``limits`` (``{"RLIMIT_FSIZE": bytes}``, set before it starts), and capture its
    output: forked from this worker's :class:`~forkserver.ForkServer` (torch imported once), or a fresh interpreter
    where ``fresh`` or where ``env`` changes what the server imported (:meth:`~forkserver.ForkServer.forkable`).
    ``transformers``: the command imports transformers though its name is not one that does
    (:data:`forkserver.TRANSFORMERS_COMMANDS`; a run whose prompt pass is on a thread of its process): forked from
    the server that imported what transformers imports."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    server = None if fresh else worker_server(full_env.get("LD_PRELOAD"), transformers or _imports_transformers(args))
    why = "fresh=True" if server is None else server.unforkable(full_env)
    forked = server.run([str(a) for a in args], full_env, timeout, script, limits) if server and why is None else None
    _log_fork(args, script, why if forked is None and why else ("busy" if forked is None else None))
    if forked is not None:
        return forked
    return subprocess.run(
        [*_command(script), *map(str, args)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        preexec_fn=partial(_set_limits, limits) if limits else None,
    )


def _imports_transformers(args: tuple[str | Path, ...]) -> bool:
    """Whether the command (its first argument that is not an option, a test's front end to the CLI's too) is one
    that imports transformers (:data:`forkserver.TRANSFORMERS_COMMANDS`): forked from the server that imported what
    transformers imports."""
    return next((str(a) for a in args if not str(a).startswith("-")), None) in TRANSFORMERS_COMMANDS


def _log_fork(args: tuple[str | Path, ...], script: Path | None, why: str | None) -> None:
    """One JSON line per CLI process a test starts, appended to the file RESUMERGE_TEST_FORKLOG names (unset: none):
    the test, the command, and why it started a fresh interpreter (None: forked) — what the suite's fresh starts
    (torch imported again, about 2-5 CPU s each) come from. Counted either way (:func:`forkserver.tally`: the
    run's summary line)."""
    tally(why)
    log = os.environ.get("RESUMERGE_TEST_FORKLOG")
    if not log:
        return
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], "kind": "cli",
            "command": str(script.name) if script else (str(args[0]) if args else ""),
            "forked": why is None, "why": why}
    with open(log, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def _set_limits(limits: dict[str, int]) -> None:
    import resource

    for limit, value in limits.items():
        resource.setrlimit(getattr(resource, limit), (value, value))


def cli_start(*args: str | Path, env: dict[str, str] | None = None, capture: bool = False,
              fresh: bool = False, script: Path | None = None) -> Forked | subprocess.Popen[str]:
    """Start ``python -m resumerge ARGS`` (or ``python SCRIPT ARGS``) in a process of its own and return at once, as
    :func:`cli` runs it (forked
    where it may be, else a fresh interpreter): a :class:`subprocess.Popen` or its forked twin (``pid``, ``poll``,
    ``wait``, ``send_signal``, ``kill``, ``communicate``), for a test that kills or signals it at a moment of its
    choosing. Its stdout and stderr go to /dev/null, or where ``capture``, to :meth:`communicate` once it has ended
    (a test that reads its output as it comes uses :class:`subprocess.Popen`)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    server = None if fresh else worker_server(full_env.get("LD_PRELOAD"), _imports_transformers(args))
    why = "fresh=True" if server is None else server.unforkable(full_env)
    forked = server.start([str(a) for a in args], full_env, capture=capture, script=script) if server and why is None \
        else None
    _log_fork(args, script, why if forked is None and why else ("busy" if forked is None else None))
    if forked is not None:
        return forked
    where = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen([*_command(script), *map(str, args)], env=full_env, stdout=where, stderr=where,
                            text=True)


def cli_start_beside(*args: str | Path, env: dict[str, str] | None = None,
                     capture: bool = False) -> Forked | subprocess.Popen[str]:
    """:func:`cli_start` for a command started while another still runs in the fork server it would be forked from
    (a server runs one at a time): forked from the worker's other server instead (the one of the commands that
    import transformers, or the plain one for those: each imports what the other does, or more), a fresh
    interpreter where that one is busy too or cannot fork it."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    usual = _imports_transformers(args)
    for transformers in (usual, not usual):
        server = worker_server(full_env.get("LD_PRELOAD"), transformers)
        why = server.unforkable(full_env)
        forked = server.start([str(a) for a in args], full_env, capture=capture) if why is None else None
        if forked is not None:
            _log_fork(args, None, None)
            return forked
    _log_fork(args, None, why or "busy")
    where = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen([*_command(None), *map(str, args)], env=full_env, stdout=where, stderr=where, text=True)


def wait_stopped(process: Forked | subprocess.Popen[str], timeout: float = 120) -> None:
    """Until ``process`` (started with ``RESUMERGE_STOP_AT``) has stopped itself at its point: it holds there what it
    holds (its locks, its journal) until the test continues it with SIGCONT. Fails if it ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone
            state = "X"
        if state == "T":
            return
        if process.poll() is not None:
            raise AssertionError(f"it ended before its stop: {process.communicate()}")
        time.sleep(0.02)
    raise AssertionError(f"process {process.pid} never stopped")


@dataclass
class Stopped:
    """A command held at its stop point by :func:`stopped_at`: its process, and once it has ended, what it printed."""

    process: Forked | subprocess.Popen[str]
    out: str = ""
    err: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


@contextmanager
def stopped_at(point: str, *args: str | Path, timeout: float = 120, finish: float = 300) -> Iterator[Stopped]:
    """``resumerge ARGS`` started as :func:`cli_start` does (output captured) with ``RESUMERGE_STOP_AT=point``, and the
    block run once it has stopped itself there (:func:`wait_stopped`): it holds its locks and journal meanwhile, as
    a slow run would. After the block it is continued (SIGCONT, also when the block failed) and waited for
    (``finish`` seconds), its output kept on the :class:`Stopped`; killed if it is still running when this ends."""
    stopped = Stopped(cli_start(*args, env={"RESUMERGE_STOP_AT": point}, capture=True))
    try:
        wait_stopped(stopped.process, timeout)
        try:
            yield stopped
        finally:
            stopped.process.send_signal(signal.SIGCONT)
        stopped.out, stopped.err = stopped.process.communicate(timeout=finish)
    finally:
        if stopped.process.poll() is None:
            stopped.process.kill()


def cli_here(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``resumerge ARGS`` through the CLI's ``main`` in this process, its stdout and stderr captured, as :func:`cli`
    returns them: for a command that is not killed, an interpreter start (and torch's import) saved. The CLI's
    parsing, its one-line errors and exit codes are the same code; a test of the process itself (a kill, the
    environment it starts with, what it imports) uses :func:`cli`."""
    out, err = io.StringIO(), io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # a run's stop flag takes them
    environ = dict(os.environ)  # main may set a variable for torch's first import
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main([str(arg) for arg in args])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess([str(arg) for arg in args], code, out.getvalue(), err.getvalue())


def drain_pty(master: int) -> str:
    """Everything written to a pseudo-terminal's other end so far, read from ``master`` (closed after)."""
    drawn = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    return drawn.decode("utf-8", "replace")


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every regular file directly in ``directory``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@contextmanager
def points_reached() -> Iterator[list[str]]:
    """The kill points (:mod:`resumerge.machine.killpoints`) that what runs in this process within the block
    reaches, each once, in the order first reached: a kill test walks those of a run never killed (the same plan
    reaches the same points) instead of starting a process at each point there is, which at a point that run never
    reaches merges to the end and checks nothing."""
    from resumerge.machine import killpoints

    reached: list[str] = []
    reach = killpoints.reach

    def recorded(point: str, **kwargs: Any) -> None:
        if point not in reached:
            reached.append(point)
        reach(point, **kwargs)

    killpoints.reach = recorded  # type: ignore[assignment]
    try:
        yield reached
    finally:
        killpoints.reach = reach  # type: ignore[assignment]


def as_on_the_hub(files: dict[str, bytes]) -> dict[str, bytes]:
    """A local OUT's ``files`` (name -> bytes) as a hub OUT of the same merge holds them: byte for byte, but for the
    manifest's records, which a folder writes as xxh3-128 and a hub repo as the sha256 its LFS names each file by
    (resumerge.machine.checksums): the same manifest, each record the sha256 of the same bytes."""
    manifest = json.loads(files[MANIFEST])
    for name, entry in manifest["committed"].items():
        assert entry["sha256"] == "xxh3-128:" + xxhash.xxh3_128_hexdigest(files[name])  # as the folder recorded it
        entry["sha256"] = hashlib.sha256(files[name]).hexdigest()
    return {**files, MANIFEST: (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()}


def hub_digests(directory: Path) -> dict[str, str]:
    """:func:`digests` of the local OUT ``directory`` as a hub OUT of the same merge holds it (`as_on_the_hub`)."""
    files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
    return {name: hashlib.sha256(data).hexdigest() for name, data in as_on_the_hub(files).items()}


def output_tensors(directory: Path) -> dict[str, Any]:
    """Every tensor of the safetensors files directly in ``directory``, by name (torch tensors)."""
    from safetensors.torch import load_file

    found: dict[str, Any] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        found.update(load_file(str(shard)))
    return found


def api_merge(tmp_path: Path, doc: dict[str, Any]) -> Path:
    """Run the config ``doc`` with ``resumerge.api.run`` into ``tmp_path/out`` (state in ``tmp_path/state``)."""
    from resumerge import api

    out = tmp_path / "out"
    api.run(yaml.safe_dump(doc, sort_keys=False), out, settings=api.Settings(state_dir=tmp_path / "state"))
    return out


def perturb_vectors(model: Any, seed: int) -> None:
    """Add noise drawn under ``seed`` to every 1-D parameter of a transformers ``model`` (transformers
    initialises norms to constants), so two seeds differ in every tensor and one model's layers differ."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def write_config(path: Path, doc: dict[str, object]) -> Path:
    """Write a YAML config and return its path."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def linear_config(a: Path, b: Path, *, weights: tuple[object, object] = (0.3, 0.7)) -> dict[str, object]:
    """A two-model linear merge."""
    return {
        "merge_method": "linear",
        "models": [
            {"model": str(a), "parameters": {"weight": weights[0]}},
            {"model": str(b), "parameters": {"weight": weights[1]}},
        ],
    }


def ties_of_three(root: Path, spec: ModelSpec) -> Path:
    """Three generated models under ``root`` (base, a, b) and a TIES config over them (compute-bound, the kind a
    cluster is for); returns the config's path, ``root / "ties.yml"``."""
    base, a, b = (make_model(root / name, spec, seed=seed) for name, seed in (("base", 0), ("a", 1), ("b", 2)))
    return write_config(root / "ties.yml", {
        "merge_method": "ties", "base_model": str(base), "dtype": "float32",
        "models": [{"model": str(a), "parameters": {"weight": 0.6, "density": 0.5}},
                   {"model": str(b), "parameters": {"weight": 0.4, "density": 0.7}}]})


@dataclass(frozen=True)
class ReferenceMerge:
    """A merge under ``root``: its config, its first model's dir and the digests of its uninterrupted run's output,
    which kill and fault tests compare their resumed outputs with."""

    root: Path
    config: Path
    a: Path
    reference: dict[str, str]

    @property
    def out(self) -> Path:
        """The reference run's output."""
        return self.root / "reference"

    @property
    def state(self) -> Path:
        """The reference run's state dir."""
        return self.root / "ref-state"

    def fresh(self, name: str) -> tuple[Path, Path]:
        """OUT and state dir of a new run ``name`` under ``root`` (``out-NAME``, ``state-NAME``), an earlier one's
        removed."""
        out, state = self.root / f"out-{name}", self.root / f"state-{name}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
        return out, state

    def killed(self, name: str, at: str, shard_size: str) -> tuple[Path, Path]:
        """OUT and state dir of a new run ``name`` of the config (``fresh``) SIGKILLed at the kill point ``at``."""
        out, state = self.fresh(name)
        killed = cli("run", self.config, out, "--state-dir", state, "--out-shard-size", shard_size, "--quiet",
                     env={"RESUMERGE_KILL_AT": at})
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        return out, state


def reference_merge(root: Path, spec: ModelSpec, shard_size: str) -> ReferenceMerge:
    """Two generated models, a linear config over them (with a gradient), and an uninterrupted reference run."""
    a = make_model(root / "a", spec, seed=1)
    b = make_model(root / "b", spec, seed=2)
    config = write_config(root / "merge.yml", linear_config(a, b, weights=([0.2, 0.8], 0.5)))
    merge = ReferenceMerge(root, config, a, {})
    # In this process (the same CLI, without a Python and torch start-up): the runs compared with it are subprocesses.
    assert main(["run", str(config), str(merge.out), "--state-dir", str(merge.state), "--out-shard-size", shard_size,
                 "--quiet"]) == 0
    return replace(merge, reference=digests(merge.out))


# Linux keeps a process's pre-exec RSS high-water mark in ru_maxrss, so a child forked from a large test process
# would report the parent's RSS. A tiny launcher process forks the real command, so wait4 sees only its peak. While
# it runs, the launcher reads the child's RssAnon + RssShmem every 20 ms and reports the most it saw (the kernel
# keeps no high-water mark of those alone).
_LAUNCHER = (
    "import os, re, sys, time\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execv(sys.argv[1], sys.argv[1:])\n"
    "held = 0\n"
    "while True:\n"
    "    done, status, usage = os.wait4(pid, os.WNOHANG)\n"
    "    if done:\n"
    "        break\n"
    "    try:\n"
    "        text = open(f'/proc/{pid}/status').read()\n"
    "        kb = sum(int(m[1]) for m in re.finditer(r'^Rss(?:Anon|Shmem):\\s+(\\d+)', text, re.M))\n"
    "        held = max(held, kb * 1024)\n"
    "    except OSError:\n"
    "        pass\n"
    "    time.sleep(0.02)\n"
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, held)\n"
)


def peak_rss_run(argv: list[str], *, timeout: float = 600) -> tuple[int, int, str]:
    """Run ``argv``; return (exit code, peak RSS bytes of that process alone, stderr)."""
    code, peak, _, err = peak_rss_and_held_run(argv, timeout=timeout)
    return code, peak, err


def peak_rss_and_held_run(argv: list[str], *, timeout: float = 600) -> tuple[int, int, int, str]:
    """Run ``argv``; return (exit code, peak RSS bytes of that process alone, the most of its memory seen to be
    anonymous or shared-memory pages (RssAnon + RssShmem, sampled every 20 ms: what a memory budget counts, without
    the file pages of its shared libraries; resumerge reads inputs with pread, never mmap), stderr). A peak that
    falls between samples only lowers the third figure."""
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *argv], capture_output=True, text=True,
                          timeout=timeout, check=False)
    code, peak, held = (int(x) for x in done.stdout.split()[-3:])
    return code, peak, held, done.stderr


def flip_byte(path: Path) -> None:
    """One bit of the middle byte flipped (same size)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate_half(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def non_utf8(path: Path) -> None:
    """Same size, one byte no UTF-8 text may hold (config.json so damaged crashed verify with UnicodeDecodeError)."""
    data = bytearray(path.read_bytes())
    data[min(5, len(data) - 1)] = 0xFF
    path.write_bytes(bytes(data))


# How verify's damage tests damage a committed file.
DAMAGE: dict[str, Callable[[Path], None]] = {
    "flipped": flip_byte, "truncated": truncate_half, "deleted": Path.unlink, "non-utf8": non_utf8}


# ``python ONE_THREAD ARGS``: the CLI with torch on one thread, as one_thread sets it here (script= of cli).
ONE_THREAD = Path(__file__).with_name("onethread.py")
TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module, imported as ``python tools/<name>.py`` runs it: with tools/ on the path, where
    it finds the scripts it builds on."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(name)


@contextmanager
def sampled_sizes(directory: Path) -> Iterator[list[int]]:
    """The bytes the files directly in ``directory`` hold (0 while it does not exist), sampled every 2 ms on a thread
    while the block runs: the list the samples are appended to (its first, 0, before any)."""
    stop, sizes = threading.Event(), [0]

    def sample() -> None:
        while not stop.is_set():
            total = 0
            for p in list(directory.iterdir()) if directory.is_dir() else []:
                try:
                    total += p.stat().st_size
                except FileNotFoundError:
                    continue
            sizes.append(total)
            stop.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield sizes
    finally:
        stop.set()
        sampler.join()


def write_files(root: Path, files: dict[str, str]) -> None:
    """Each file of ``files`` (a path relative to ``root``: its text) written under ``root``, its folders made."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def relayout_once(name: str, root: Path, files: dict[str, str]) -> tuple[ModuleType, list[str]]:
    """``tools/<name>.py`` run once on ``files`` written under ``root`` (:func:`write_files`): the tool's module and
    the lines its run said."""
    write_files(root, files)
    tool = load_tool(name)
    return tool, tool.relayout(root)


def relayout_again(tool: ModuleType, root: Path) -> list[str]:
    """A relayout ``tool`` (:func:`relayout_once`) run a second time on ``root``: the lines it said, once asserted that
    it changed no file (caches aside)."""
    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in root.rglob("*")
                if p.is_file() and not {".ruff_cache", "__pycache__"} & set(p.parts)}

    before = files()
    said: list[str] = tool.relayout(root)
    assert files() == before
    return said


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Torch on ``count`` threads in this process for the block, the count before restored after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread in this process for the block (float32 sums on more threads may round otherwise)."""
    with torch_threads(1):
        yield


def loopback_only(monkeypatch: Any) -> None:
    """Let this process resolve 127.0.0.1 and localhost only (``monkeypatch``: pytest's): a URL built from an
    import-time constant fails loudly instead of ever reaching a real hub."""
    real = socket.getaddrinfo

    def resolve(host: object, *args: Any, **kwargs: Any) -> Any:
        if host not in ("127.0.0.1", "localhost", b"127.0.0.1", b"localhost"):
            raise OSError(f"test tried to reach {host!r}; only 127.0.0.1 is allowed")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
