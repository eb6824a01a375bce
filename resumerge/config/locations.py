"""Where a run keeps its state: one folder per output directory under the state dir (never inside OUT).

The state dir is ``--state-dir``, else ``$RESUMERGE_STATE_DIR``, else the user's own one,
``$XDG_STATE_HOME/resumerge`` (``~/.local/state/resumerge`` without it), so ``status OUT`` and ``resume OUT`` find
the ledger from any working directory. Runs recorded under ``./state`` (the default of earlier versions) keep
being found there from that directory. Keep it on a local disk: SQLite fails on FUSE mounts such as Drive.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from resumerge.config.hubtarget import is_hub_target, parse_hub_target
from resumerge.config.version import __version__

ENV_STATE_DIR = "RESUMERGE_STATE_DIR"
# A merge's ledger, in its run dir.
LEDGER_NAME = "ledger.db"
# Where output files are staged by default (Drive and other remote OUTs), in the run dir.
STAGING_NAME = "staging"
# Under the state dir: the MoE prompt forward passes, each in a folder named by its content key.
ROUTERS_DIR = "moe-routers"
# Under the state dir: the lock of each of those passes, named by its key (beside its folder, which holds only the
# pass's journal and routers).
ROUTER_LOCKS_DIR = "moe-routers-locks"
# Under the state dir: one folder per check, named by its content key.
CHECKS_DIR = "checks"
EVALS_DIR = "evals"  # each eval pass's journal and answers, one folder per pass
MEASURES_DIR = "measures"
# Under the state dir: the folder of each GGUF model a check or a MoE prompt pass reads (config.json, tokenizer).
GGUF_DIR = "gguf"
# Under the state dir: the small files (config.json, tokenizer) of each merge read without being written.
UNWRITTEN_DIR = "unwritten"


# The default state dir of earlier versions, relative to the working directory; still read for runs recorded there.
LEGACY_STATE_DIR = "state"


def cache_root() -> Path:
    """Where resumerge keeps measurements of this installation (the memory a fresh process holds once it has imported
    what a command needs): ``$XDG_CACHE_HOME/resumerge``, else ``~/.cache/resumerge``. Deleting it costs a new
    measurement, nothing else."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "resumerge"


def kept_file(folder: str, key: object, prefix: str = "", cache_dir: Path | None = None) -> Path:
    """Where a cache of this installation keeps what it found for ``key`` (JSON-able: the facts the finding
    depends on, the versions of the code that found it): a file under ``folder`` of ``cache_dir`` (default
    :func:`cache_root`) named ``prefix`` + the digest of the key and resumerge's version, so that another fact or
    another resumerge names another file and a stale finding is never read. A key JSON cannot write as it is (an
    object of its own) is written by its ``repr``."""
    text = json.dumps([__version__, key], sort_keys=True, default=repr)
    root = cache_dir if cache_dir is not None else cache_root()
    return root / folder / f"{prefix}{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def replace_text(path: Path, text: str) -> None:
    """Write a cache's file whole (its folder made): a temp file beside it, renamed over it, so a reader sees the
    old file or the new, never a torn one. Not fsynced: a cache file lost to a crash is found again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def default_state_root() -> Path:
    """The user's own state dir: ``$XDG_STATE_HOME/resumerge``, else ``~/.local/state/resumerge``."""
    xdg = os.environ.get("XDG_STATE_HOME")
    # The XDG spec: a relative path is invalid and is ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return base / "resumerge"


def state_root(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """The state directory in force for this process."""
    if state_dir is not None:
        return Path(state_dir)
    env = os.environ.get(ENV_STATE_DIR)
    return Path(env) if env else default_state_root()


def is_default_state_root(state_dir: str | os.PathLike[str] | None) -> bool:
    """Whether ``state_dir`` is where a command given no ``--state-dir`` looks (so a printed command may omit it)."""
    return state_dir is None or os.path.abspath(state_dir) == os.path.abspath(state_root())


def run_dir(out_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding the ledger and lock of ``out_dir``: ``<name>-<12 hex of its real path>`` (for an
    ``hf://`` repo: ``hf-<namespace>--<name>-<12 hex of the target>``, the same on every machine).

    With no state dir given or set in the environment, a run recorded under ``./state`` (the earlier default)
    is found there."""
    return StateDir.resolve(state_dir).run_dir(out_dir)


def _run_name(out_dir: str | os.PathLike[str]) -> str:
    """The name of ``out_dir``'s run folder under the state dir."""
    if is_hub_target(out_dir):
        return parse_hub_target(str(out_dir)).state_key()
    real = os.path.realpath(out_dir)
    return f"{Path(real).name or 'root'}-{hashlib.sha256(real.encode()).hexdigest()[:12]}"


def resume_command(out_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None) -> str:
    """The shell command that finishes the merge into ``out_dir`` (with ``--state-dir`` when it is not the one a
    command finds by itself)."""
    command = f"resumerge resume {shlex.quote(os.fspath(out_dir))}"
    if state_dir is None or is_default_state_root(state_dir):
        return command
    return f"{command} --state-dir {shlex.quote(os.fspath(state_dir))}"


class _Folder:
    """A folder of the state dir named once, read as an attribute of a :class:`StateDir` (``state.checks_dir`` is
    ``state.root / CHECKS_DIR``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, state: StateDir, owner: type[StateDir] | None = None) -> Path:
        return state.root / self.name


@dataclass(frozen=True)
class StateDir:
    """The state dir of one call, resolved once at the front door (:meth:`resolve`) and handed down whole, so
    that nothing below the API derives it again from the string it was given: ``given`` as given (None: the
    default), ``root`` the state dir in force, ``legacy`` whether runs recorded under ``./state`` (the default of
    earlier versions) are looked for (no state dir given nor set in the environment)."""

    given: str | os.PathLike[str] | None
    root: Path
    legacy: bool

    @classmethod
    def resolve(cls, given: str | os.PathLike[str] | None = None) -> StateDir:
        """The state dir in force for ``given`` (None: ``$RESUMERGE_STATE_DIR``, else the user's own one)."""
        return cls(given, state_root(given), given is None and not os.environ.get(ENV_STATE_DIR))

    def run(self, out: str | os.PathLike[str]) -> RunLocations:
        """The locations of the run into ``out``."""
        return RunLocations(os.fspath(out), self, self.run_dir(out), self.resume_command(out))

    def run_dir(self, out: str | os.PathLike[str]) -> Path:
        """The run folder of ``out`` (see :func:`run_dir`)."""
        name = _run_name(out)
        if self.legacy:
            legacy = Path.cwd() / LEGACY_STATE_DIR / name
            if legacy.is_dir():
                return legacy
        return self.root / name

    def resume_command(self, out: str | os.PathLike[str]) -> str:
        """The shell command that finishes the merge into ``out`` (see :func:`resume_command`)."""
        return resume_command(out, self.given)

    @property
    def records_dir(self) -> Path:
        """Where the verification records of downloaded files are kept."""
        return self.root

    # Where each ``check`` keeps its journal and progress, one folder per check.
    checks_dir = _Folder(CHECKS_DIR)
    # Where each ``eval`` keeps its passes' journals and answers and its progress.
    evals_dir = _Folder(EVALS_DIR)
    # Where each ``measure`` journals its passes (hidden states, a hub model's reads), one folder per measurement;
    # its Grams go to its OUT_DIR.
    measures_dir = _Folder(MEASURES_DIR)
    # Where each mergekit-moe prompt forward pass keeps its layers and routers, one folder per pass.
    routers_dir = _Folder(ROUTERS_DIR)
    # Where each mergekit-moe prompt forward pass's lock is, named by its key: one process at a time runs it.
    router_locks_dir = _Folder(ROUTER_LOCKS_DIR)
    # Where each GGUF model read by a check or a MoE prompt pass gets its folder of rebuilt files
    # (:func:`resumerge.inputs.gguf.folder.gguf_folder`).
    gguf_dir = _Folder(GGUF_DIR)
    # Where each merge read without being written gets its folder of small files (config.json, tokenizer), one per
    # plan (:mod:`resumerge.merge.engine.unwritten`).
    unwritten_dir = _Folder(UNWRITTEN_DIR)


@dataclass(frozen=True)
class RunLocations:
    """Where the run into one OUT keeps its state, resolved once (:meth:`StateDir.run`) and read by every step of
    the run instead of each deriving it again from the state dir: ``out`` as given (a folder or an ``hf://``
    target), the state dir (``state``), the run's folder (``run_dir``: ledger, lock, staging, caches) and the
    command that resumes it."""

    out: str
    state: StateDir
    run_dir: Path
    resume_command: str

    @classmethod
    def of(cls, out: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None) -> RunLocations:
        """The locations of the run into ``out`` under ``state_dir`` (resolved here: a caller that holds a
        :class:`StateDir` asks it instead)."""
        return StateDir.resolve(state_dir).run(out)

    def beside(self, out: str | os.PathLike[str]) -> RunLocations:
        """The locations of another OUT under the same state dir (a recipe's stages, and its repo by its URL)."""
        return self.state.run(out)

    @property
    def root(self) -> Path:
        """The state dir in force."""
        return self.state.root

    @property
    def ledger(self) -> Path:
        """The run's ledger."""
        return self.run_dir / LEDGER_NAME

    @property
    def staging(self) -> Path:
        """Where output files are staged when no directory is given for it."""
        return self.run_dir / STAGING_NAME
