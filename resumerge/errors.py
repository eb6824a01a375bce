"""The one exception hierarchy of resumerge, and the table that maps it to exit codes.

::

    ResumergeError                      exit 1  internal / unexpected
    ├── InputError                      exit 2  the user's config or inputs are wrong
    │   ├── ConfigError                         YAML syntax, schema, parameters, slices (carries yaml_path)
    │   ├── ModelInputError                     a model directory, config.json, index or header is unusable
    │   │   └── HostileFileError                a file that tries to escape, lie about sizes or execute code
    │   ├── UsageError                          the command line itself is wrong
    │   │   └── NoSuchOutputError               OUT names nothing at all (also a NothingRecordedError)
    │   └── UnreachableInputError               a hub input unreachable before a run recorded anything
    ├── InterruptedMerge                exit 3  stopped at a safe point (signal); resumable
    ├── RefusedError                    exit 4  state mismatch or damage resumerge will not paper over
    │   ├── PlanChangedError                    config, options or input files differ from the recorded run
    │   ├── OutputDirError                      OUT holds files resumerge did not write, or is locked
    │   └── LedgerError                         the ledger cannot be read and cannot be rebuilt
    │       └── NothingRecordedError            OUT (a folder or hf:// repo) holds no run: resume, status, verify
    │           ├── KilledPlanningError         none, because the run was killed while it planned
    │           └── NoSuchOutputError           exit 2: OUT names nothing at all (also a UsageError)
    ├── StorageError                    exit 3  disk full, EIO, read-only: nothing committed is lost
    └── UnreachableError                exit 3  the hub cannot be reached and the cache cannot stand in

    resumerge check's verdicts, which are no errors: works exit 0, no effect exit 5 (the merge is
    indistinguishable from its base or one parent), broken exit 6 (non-finite values, NLL far above its
    parents', or a layer that departs from all of them).

Every error carries the context a user needs (file, YAML path, tensor) and a message that says what to do.
Only the CLI turns errors into exit codes, through :data:`EXIT_CODES`; each error's ``exit_code`` is its row.
The CLI prints :meth:`ResumergeError.one_line`; ``str(error)`` is the same line in a notebook's words: every
option named by its keyword (``max_memory``, not ``--max-memory``), except inside a ``resumerge …`` command.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from types import MappingProxyType

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 3
EXIT_REFUSED = 4
# resumerge check's verdicts (a finished check: no exception carries them).
EXIT_NO_EFFECT = 5
EXIT_BROKEN = 6

# What each exit code tells a script (docs/commands.md is written from this table).
EXIT_MEANINGS: Mapping[int, str] = MappingProxyType({
    EXIT_OK: "done; `check`: the merge works",
    EXIT_INTERNAL: "an internal error (a bug: the line says what failed; please report it)",
    EXIT_INVALID: "bad input: the config, a model, or the command line (one line says what, where and what to do); "
                  "nothing was downloaded or written",
    EXIT_INTERRUPTED: "stopped at a safe point (Ctrl-C, a signal, a full disk, an unreachable hub): nothing committed "
                      "is lost, the line gives the command that continues",
    EXIT_REFUSED: "refused: OUT, the ledger or an input differs from the recorded run, or holds files resumerge did "
                  "not write (the line names what)",
    EXIT_NO_EFFECT: "`check`: no effect (the merge is indistinguishable from its base or one parent)",
    EXIT_BROKEN: "`check`: broken (non-finite values, NLL far above its parents', or a layer that departs from all "
                 "of them)",
})

# Flags whose keyword in resumerge.api is not the flag's own words (--max-memory is max_memory; --no-X is
# X=False); tests/test_front_door.py holds this table to the parser's dests.
API_NAMES: Mapping[str, str] = MappingProxyType({
    "-j/--num-threads": "num_threads",
    "--out-path": "out",
    "--transformers-cache": "cache_dir",
    "--staging-dir": "staging",
    "--no-staging": "staging=False",
    "--cuda": "device='cuda'",
    "--i-understand-this-is-not-useful-without-training": "allow_same_experts",
    "--i-understand-the-depths-of-the-evils-i-am-unleashing": "allow_benchmark_tasks",
    "--save-module": "save_modules",
    "--exclude-regex": "exclude_regexes",
    "--include-regex": "include_regexes",
    "--parent": "parents",
    "--gguf-tensor-type": "gguf_tensor_types",
    "--pure": "gguf_pure",
})
# A flag (not part of a path or word), or a whole ``resumerge …`` command, whose flags stay as typed.
_FLAG = re.compile(r"resumerge (?:run|resume|plan|status|verify|extract-lora|check)\b[^;)—]*"
                   r"|(?<![\w/.-])(?:-j/)?--[a-z][a-z0-9-]*")


def api_words(line: str) -> str:
    """``line`` with each command-line flag named as :mod:`resumerge.api`'s keyword for it (see :data:`API_NAMES`),
    leaving ``resumerge …`` commands as they are."""
    def keyword(match: re.Match[str]) -> str:
        flag = match.group(0)
        if flag.startswith("resumerge "):
            return flag
        if flag in API_NAMES:
            return API_NAMES[flag]
        if flag.startswith("--no-"):
            return flag[5:].replace("-", "_") + "=False"
        return flag.lstrip("-").replace("-", "_")

    return _FLAG.sub(keyword, line)


class ResumergeError(Exception):
    """Base of every error resumerge raises on purpose.

    ``hint`` is the next step for the user; ``path``, ``yaml_path`` and ``tensor`` locate the problem.
    """

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        path: str | None = None,
        yaml_path: str | None = None,
        tensor: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.path = path
        self.yaml_path = yaml_path
        self.tensor = tensor

    def __str__(self) -> str:
        """The CLI's line (:meth:`one_line`: where, what, and what to do) with the API's option names."""
        return api_words(self.one_line())

    @property
    def exit_code(self) -> int:
        """The exit code the CLI ends with for this error (its row of :data:`EXIT_CODES`)."""
        return exit_code_for(self)

    def one_line(self) -> str:
        """Render the error as the single line the CLI prints."""
        parts = []
        if self.yaml_path:
            parts.append(f"{self.yaml_path}: ")
        elif self.path:
            parts.append(f"{self.path}: ")
        parts.append(self.message)
        if self.tensor and self.tensor not in self.message:
            parts.append(f" (tensor {self.tensor})")
        if self.hint:
            parts.append(f" — {self.hint}")
        return "".join(parts)


class InputError(ResumergeError):
    """The user's config or input files are wrong; nothing has been written."""


class UnreachableInputError(InputError):
    """A hub input could not be reached while planning a new run: nothing was recorded, so there is nothing to
    resume (an :class:`UnreachableError` met later, mid-run, stays exit 3)."""

    @classmethod
    def before_start(cls, exc: UnreachableError, *, done: str = "nothing was started") -> UnreachableInputError:
        """``exc``, met before anything was recorded: exit 3's "resume finishes it" would be wrong there. ``done``
        says what the command left (``plan``: it writes nothing)."""
        return cls(exc.message, path=exc.path, yaml_path=exc.yaml_path,
                   hint=f"{done}: check the network (or HF_ENDPOINT), then run the same command again")


class ConfigError(InputError):
    """The YAML config is malformed or inconsistent; ``yaml_path`` says where."""


class ModelInputError(InputError):
    """A model directory, its config.json, index or safetensors header is unusable."""


class HostileFileError(ModelInputError):
    """A file that would escape its directory, lies about sizes, or would execute code; refused unread."""


class UsageError(InputError):
    """The command line is wrong (bad option value, missing file)."""


class InterruptedMerge(ResumergeError):
    """The merge stopped at a safe point after a signal; ``resume_command`` finishes it."""

    def __init__(self, message: str, *, resume_command: str) -> None:
        super().__init__(message, hint=f"finish it with: {resume_command}")
        self.resume_command = resume_command


class RefusedError(ResumergeError):
    """resumerge refuses to continue because state and request disagree."""


class PlanChangedError(RefusedError):
    """The recorded run was planned from other config, options or input files."""


class OutputDirError(RefusedError):
    """The output directory holds foreign files, or another process is merging into it."""


class LedgerError(RefusedError):
    """The ledger is unreadable and OUT has no manifest to rebuild it from."""


class NothingRecordedError(LedgerError):
    """No run is recorded for the OUT given (no ledger in the state dir, no manifest in OUT or the repo): one
    answer, exit 4, for ``resume``, ``status`` and ``verify``, local or ``hf://``."""

    @classmethod
    def of(cls, out: object, what: str = "merge") -> NothingRecordedError:
        """The refusal for a local ``out`` of which neither the state dir nor OUT holds a record of a ``what``
        (``merge``, ``recipe``): what is missing and where to look; where ``out`` is no file or folder at all, a
        :class:`NoSuchOutputError`."""
        if not os.path.lexists(str(out)):
            return NoSuchOutputError("no such folder", path=str(out), hint="check the output path")
        return cls(f"no {what} recorded for {out}", path=str(out),
                   hint="pass the --state-dir used by the run, or check the output path")


class NoSuchOutputError(UsageError, NothingRecordedError):
    """Nothing is recorded because OUT names no file or folder at all: a path mistyped (exit 2, as bad input is),
    still a :class:`NothingRecordedError` to a caller that asks whether a run exists (a notebook's resume cell)."""


class KilledPlanningError(NothingRecordedError):
    """Nothing is recorded because the run was killed while it planned; ``kind`` names the kind of run its planning
    mark named (empty: not named), whose own account of what it had done the API adds to the hint."""

    def __init__(self, message: str, *, kind: str = "", hint: str | None = None, path: str | None = None) -> None:
        super().__init__(message, hint=hint, path=path)
        self.kind = kind


class StorageError(ResumergeError):
    """Writing failed (disk full, I/O error, read-only); committed work is intact and resumable."""


class UnreachableError(ResumergeError):
    """A network source (the Hugging Face Hub) is unreachable right now; running again later continues."""

    @classmethod
    def after_start(cls, exc: UnreachableError, resume_command: str) -> UnreachableError:
        """``exc``, met while a run is recorded: what it committed stays and ``resume_command`` finishes it once
        the hub answers (an error that already says what to do, OUT's hub or a Ray cluster, is kept)."""
        if exc.hint is not None:
            return exc
        return cls(exc.message, path=exc.path, yaml_path=exc.yaml_path, tensor=exc.tensor,
                   hint=f"everything committed stays committed; run {resume_command} when the hub answers")


# Most specific class first: the first isinstance match wins.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (InputError, EXIT_INVALID),
    (InterruptedMerge, EXIT_INTERRUPTED),
    (StorageError, EXIT_INTERRUPTED),
    (UnreachableError, EXIT_INTERRUPTED),
    (RefusedError, EXIT_REFUSED),
    (ResumergeError, EXIT_INTERNAL),
)


def exit_code_for(error: BaseException) -> int:
    """Return the process exit code for ``error`` (1 for anything not in the table)."""
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return code
    return EXIT_INTERNAL
