"""Start the prompt work of a mergekit-moe config (tokenising, the hidden-state forward pass) in a process of its
own, :mod:`resumerge.runs.moe.passmain`, and take its answer: the run's process never imports transformers, so the
half gigabyte it costs is held only while the prompt work runs, by that process alone.

:func:`start_child` returns at once (the child's imports overlap what the run does meanwhile: planning, the
merge); :meth:`PassProcess.result` waits for the answer. Its errors come back as the same
:class:`~resumerge.errors.ResumergeError` subclass (one line, the same exit code); a child that dies otherwise is
reported as a failure of the pass, which a rerun continues at the layer it reached.

May import: errors, inputs (files), moe (not its transformers-using modules). Light: the run's process starts the
child before it imports torch itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge import errors
from resumerge.config.locations import StateDir
from resumerge.errors import InputError, ResumergeError
from resumerge.inputs.files import TOKENIZER_FILES

if TYPE_CHECKING:  # the forward engine is the prompt pass's process's, never imported by the run's up front
    from resumerge.forward.engine.requires import Needs

HIDDEN_MODES = frozenset({"hidden", "hidden_avg", "hidden_last"})
# The line the pass's process writes once it has made every check it makes before its first weight (then the run's
# merge starts: see PassProcess.checked).
CHECKED_LINE = '{"checked": true}'
# The word in the command line of a pass's process started with its job (not early): it reads the job before it
# imports anything, and imports only what that job needs (see resumerge.runs.moe.passmain.main).
JOB_GIVEN = "--job-given"
# resumerge is on no package index: its extra installs only from a clone or a wheel, transformers from anywhere.
INSTALL_HINT = "pip install transformers (the moe extra: pip install -e '.[moe]' in a clone)"

# (positive, negative or None) prompt texts of each gated expert
PromptSets = Sequence[tuple[Sequence[str], Sequence[str] | None]]


def gate_needs(gate_mode: str) -> Needs:
    """How the hidden-state gate modes' refusals read when transformers is missing or broken (the YAML path
    ``gate_mode``, the modes that need no transformers named)."""
    from resumerge.forward.engine.requires import Needs

    instead = ", or use gate_mode random or uniform_random"
    return Needs(f"gate_mode {gate_mode}", missing=" to read the prompts", hint=f"{INSTALL_HINT}{instead}",
                 broken="the installed one fails to import",
                 broken_hint=f"pip install -U transformers (in a version that fits the installed packages){instead}",
                 yaml_path="gate_mode")


def transformers_usable(gate_mode: str) -> None:
    """Raise :class:`InputError` (exit 2), before anything is written, when transformers is not installed (naming
    the install command: :func:`~resumerge.forward.engine.requires.require_transformers`) or is installed with a
    requirement of its own unmet (naming both versions: such a transformers fails to import). Read from the
    installed metadata, without importing transformers; the child checks its import again and reports any other
    ImportError as it is."""
    from resumerge.forward.engine.requires import require_transformers

    require_transformers(gate_needs(gate_mode), load=False)
    unmet = unmet_requirement("transformers")
    if unmet is not None:
        raise InputError(f"gate_mode {gate_mode} needs transformers, and the installed one cannot be imported: "
                         f"{unmet}", yaml_path="gate_mode",
                         hint="pip install -U transformers (in a version that fits the installed packages), or "
                         "use gate_mode random or uniform_random")


def unmet_requirement(distribution: str) -> str | None:
    """The first requirement of the installed ``distribution`` (extras aside) that an installed package does not
    meet, as a sentence naming both versions (transformers checks the same at import, and fails); None when all
    are met or the metadata cannot tell."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # packaging comes with transformers; without it there is nothing to compare with
        return None
    try:
        requires = importlib.metadata.requires(distribution) or []
        own = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # its module may be there without metadata: the import will tell
        if not requirement.specifier.contains(installed, prereleases=True):
            return f"{distribution} {own} needs {requirement}, and {requirement.name} {installed} is installed"
    return None


def routers_key(weight_files: Sequence[tuple[str, int, str]], mode: str, prompts: PromptSets,
                tokenizer_dir: Path, *, torch_version: str | None = None) -> str:
    """The content key of a forward pass: the base's weight files, the mode, the prompts, the tokenizer's files
    and the versions of the code that computes it (read without importing transformers; ``torch_version``: torch's
    as its caller read it, None: ``torch.__version__``, importing torch)."""
    tokenizer = sorted((name, hashlib.sha256((tokenizer_dir / name).read_bytes()).hexdigest())
                       for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file())
    if torch_version is None:
        import torch

        torch_version = str(torch.__version__)
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = None
    doc = [list(weight_files), mode, [[list(p), list(n) if n else None] for p, n in prompts], tokenizer, version,
           torch_version]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def run_child(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Do ``job`` (see :mod:`resumerge.runs.moe.passmain`) in a child process and return its answer; raises the
    child's :class:`ResumergeError` again, or one saying how it died. The child is gone when this returns."""
    return start_child(job, workdir).result()


@contextmanager
def started_early(gate_mode: str | None, state: StateDir,
                  finished: Callable[[], bool] = lambda: False) -> Iterator[PassProcess | None]:
    """A process for the hidden-state gate modes' forward pass, started now to load while the run plans (its job
    comes later), and stopped when the block ends (a run that ended without its routers, or needed no pass,
    leaves no process running); None for the other modes, without transformers (refused later), or where
    ``finished`` (asked only for those modes) says the run will find its routers finished (a run continuing one
    past its pass: :func:`resumerge.runs.moe.passdone.routers_finished`; the planner starts a process if they are
    not)."""
    if gate_mode not in HIDDEN_MODES or importlib.util.find_spec("transformers") is None or finished():
        yield None
        return
    child = PassProcess(state.routers_dir)
    try:
        yield child
    finally:
        child.stop()


def start_child(job: dict[str, Any], workdir: Path, started: PassProcess | None = None) -> PassProcess:
    """Give ``job`` to the process ``started`` earlier (None: a new one) and return it at once (see
    :class:`PassProcess`)."""
    transformers_usable(job["mode"])
    child = started if started is not None else PassProcess(given=True)
    child.send(job, workdir)
    return child


class PassProcess:
    """The prompt work's process. Started before its job is known, it loads torch and transformers meanwhile (so
    an interpreter start with them overlaps the run's own), then waits for :meth:`send`; ``where`` (shown in its
    command line) says where its work will go. ``given``: started with its job (:meth:`send` follows at once), it
    reads the job first and loads only what that job needs. Its answer is taken on a thread of this process, so the
    caller goes on meanwhile. Started from the calling thread: the kernel's parent-death signal follows the thread
    that starts a child, and the caller's thread lives as long as the run."""

    def __init__(self, where: Path | None = None, *, given: bool = False) -> None:
        env = dict(os.environ)
        # The child imports this very resumerge, whatever put it on this process's path.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "resumerge.runs.moe.passmain", str(os.getpid()), *([JOB_GIVEN] if given else []),
                *([str(where)] if where else [])]
        self._child = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
        self._streams: tuple[str, str] = ("", "")
        self._reader: threading.Thread | None = None
        self._checked = threading.Event()  # set when the child says it made its checks, or when it ends
        self._said_checked = False

    def send(self, job: dict[str, Any], workdir: Path) -> None:
        """Give the child its ``job``, working in ``workdir``."""
        text = json.dumps({**job, "workdir": str(workdir), "parent": os.getpid()})
        self._reader = threading.Thread(target=self._read, args=(text,), name="resumerge-prompt-pass", daemon=True)
        self._reader.start()

    def _read(self, job: str) -> None:
        """Hand the child ``job`` and read what it writes until it ends: its answer, and on the way the line saying
        it made its checks. As ``communicate`` does, the job is written and stderr read on threads of their own, so
        that no pipe fills while another waits."""
        child, err = self._child, [""]
        stdin, stdout, stderr = child.stdin, child.stdout, child.stderr
        assert stdin is not None and stdout is not None and stderr is not None

        def write() -> None:
            with contextlib.suppress(OSError, ValueError):  # the child died before it read its job: its status tells
                stdin.write(job)
                stdin.close()

        def drain() -> None:
            with contextlib.suppress(OSError, ValueError):
                err[0] = stderr.read()

        helpers = [threading.Thread(target=work, name=f"resumerge-prompt-pass-{work.__name__}", daemon=True)
                   for work in (write, drain)]
        for helper in helpers:
            helper.start()
        lines: list[str] = []
        try:
            for line in stdout:
                if line.strip() == CHECKED_LINE:
                    self._said_checked = True
                    self._checked.set()
                else:
                    lines.append(line)
        except (OSError, ValueError):  # killed meanwhile: the answer is the exit status
            pass
        finally:
            child.wait()
            for helper in helpers:
                helper.join()
            for stream in (stdin, stdout, stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.close()
            self._streams = ("".join(lines), err[0])
            self._checked.set()

    def checked(self) -> None:
        """Wait until the child has made every check its job makes before its first weight
        (:func:`resumerge.runs.moe.forward.pass_checks` and its memory share); raises its error when one failed (it has
        ended then). A run's merge starts only after this: ``run`` refuses before its first weight what ``plan``
        refuses."""
        assert self._reader is not None, "no job was sent"
        self._checked.wait()
        if not self._said_checked:
            self.result()  # ended without passing them: its error (or its answer: nothing was left to do)

    def running(self) -> bool:
        """Whether the child has its job and has not answered yet."""
        return self._reader is not None and self._reader.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until it ends) for the child's answer; True once it has ended."""
        assert self._reader is not None, "no job was sent"
        self._reader.join(timeout)
        return not self._reader.is_alive()

    def stop(self) -> None:
        """Kill the child if it still runs (the run stopped or failed, or needs no pass: it must not go on
        alone)."""
        if self._child.poll() is None:
            self._child.kill()
        if self._reader is not None:
            self._reader.join()
        else:  # never given a job: reap it and close its pipes
            self._read("")

    def result(self) -> dict[str, Any]:
        """Wait for the child and return its answer; raises its :class:`ResumergeError` again, or one saying how
        it died. The child is gone when this returns (interrupted here, it is killed)."""
        assert self._reader is not None, "no job was sent"
        try:
            self._reader.join()
        finally:
            if self._reader.is_alive():
                self.stop()
        out, err = self._streams
        child = self._child
        answer = _answer(out)
        if answer is not None and "error" in answer:
            raise _rebuilt(answer["error"])
        if answer is not None and child.returncode == 0:
            ok: dict[str, Any] = answer["ok"]
            return ok
        if child.returncode in (-signal.SIGINT, 130):
            raise KeyboardInterrupt
        if child.returncode < 0:
            name = signal.Signals(-child.returncode).name
            raise ResumergeError(f"the prompt forward pass (process {child.pid}) was killed by {name}",
                                 hint="run the same command again: the pass continues at the layer it reached"
                                 + ("; if memory ran out, give it a smaller --max-memory or more memory"
                                    if child.returncode == -signal.SIGKILL else ""))
        last = next((line for line in reversed(err.splitlines()) if line.strip()), "no message")
        raise ResumergeError(f"the prompt forward pass failed (exit {child.returncode}): {last.strip()}")


def _answer(out: str) -> dict[str, Any] | None:
    """The child's JSON answer: its last line of output (libraries may print before it)."""
    for line in reversed(out.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        return doc if isinstance(doc, dict) else None
    return None


def _rebuilt(doc: dict[str, Any]) -> ResumergeError:
    """The child's error as the same class, with the same fields (an unknown class: a plain ResumergeError)."""
    kind = getattr(errors, str(doc.get("class")), None)
    if not (isinstance(kind, type) and issubclass(kind, ResumergeError)) or kind is errors.InterruptedMerge:
        kind = ResumergeError
    error = kind(str(doc["message"]), hint=doc.get("hint"), path=doc.get("path"), yaml_path=doc.get("yaml_path"),
                 tensor=doc.get("tensor"))
    return error
