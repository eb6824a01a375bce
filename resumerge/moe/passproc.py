"""Start the prompt work of a mergekit-moe config (tokenising, the hidden-state forward pass) in a process of its
own, :mod:`resumerge.moe.passmain`, and wait for its answer: the run's process never imports transformers, so the
half gigabyte it costs is held only while the prompt work runs, and the merge after it gets the whole budget.

The child runs alone (the merge waits for it), under the budget less what this process holds. Its errors come
back as the same :class:`~resumerge.errors.ResumergeError` subclass (one line, the same exit code); a child that
dies otherwise is reported as a failure of the pass, which a rerun continues at the layer it reached.

May import: errors, memory, moe (not its transformers-using modules).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from resumerge import errors
from resumerge.errors import InputError, ResumergeError
from resumerge.inputs.files import TOKENIZER_FILES
from resumerge.moe.prompts import INSTALL_HINT

# (positive, negative or None) prompt texts of each gated expert
PromptSets = Sequence[tuple[Sequence[str], Sequence[str] | None]]


def require_transformers(gate_mode: str) -> None:
    """Raise :class:`InputError` (exit 2) naming the install command when transformers is not installed (the
    child checks its import again: a broken install is reported from there, as the same line)."""
    if importlib.util.find_spec("transformers") is None:
        raise InputError(f"gate_mode {gate_mode} needs transformers to read the prompts", yaml_path="gate_mode",
                         hint=f"{INSTALL_HINT}, or use gate_mode random or uniform_random")


def routers_key(weight_files: Sequence[tuple[str, int, str]], mode: str, prompts: PromptSets,
                tokenizer_dir: Path) -> str:
    """The content key of a forward pass: the base's weight files, the mode, the prompts, the tokenizer's files
    and the versions of the code that computes it (read without importing transformers)."""
    tokenizer = sorted((name, hashlib.sha256((tokenizer_dir / name).read_bytes()).hexdigest())
                       for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file())
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = None
    doc = [list(weight_files), mode, [[list(p), list(n) if n else None] for p, n in prompts], tokenizer, version,
           torch.__version__]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def run_child(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Do ``job`` (see :mod:`resumerge.moe.passmain`) in a child process and return its answer; raises the
    child's :class:`ResumergeError` again, or one saying how it died. The child is gone when this returns."""
    require_transformers(job["mode"])
    env = dict(os.environ)
    # The child imports this very resumerge, whatever put it on this process's path.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    child = subprocess.Popen([sys.executable, "-m", "resumerge.moe.passmain", str(workdir)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(json.dumps({**job, "parent": os.getpid()}))
    finally:
        if child.poll() is None:  # interrupted here: the child must not go on alone
            child.kill()
            child.wait()
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
