"""The prompt work of a mergekit-moe config, in a process of its own: ``python -m resumerge.runs.moe.passmain PARENT
[--job-given] [WHERE]`` (the run's process id, whether its job is written already, and where its work goes, for the
eye).

transformers (the tokenizer, the decoder layers' modules) adds about half a gigabyte to any process that imports
it, and keeps it: run in the merge's process, that memory would count against ``--max-memory`` for the whole
merge. So the run's process (:mod:`resumerge.runs.moe.passproc`) starts this one for the prompt work only and never
imports transformers itself. It loads torch and transformers as soon as it starts (the run's process starts it
before its own imports and planning, which then overlap these), then reads one job as JSON from stdin, with the
``workdir`` it works in (started with its job, ``--job-given``, it reads the job first, and a job that only
tokenises loads only the tokenizer):

``encode``
    tokenise every gated expert's prompt sets (``cheap_embed``); the answer carries them.
``probe``
    make the pass's checks (:func:`resumerge.runs.moe.forward.pass_checks`: its code loaded, the base's modules built
    without weights, the tokenizer loaded, the prompts encoded); the answer is what that holds and took (``plan``'s
    estimate of the pass).
``routers``
    make the same checks and the memory share's, say so (:data:`~resumerge.runs.moe.passproc.CHECKED_LINE`: the run's
    merge waits for it), then run the hidden-state forward pass one decoder layer at a time
    (:func:`resumerge.runs.moe.forward.hidden_routers`) into ``WORKDIR``, under the memory share it was given.

The answer is one JSON line on stdout: ``{"ok": ...}``, or ``{"error": ...}`` for a :class:`ResumergeError`,
which the run's process raises again as the same class. This process dies with its parent (a killed run leaves
no pass running on): the kernel's parent-death signal where there is one, and a thread that watches the parent
everywhere.

May import: errors, inputs, memory, moe (its transformers-using modules included), store (killpoints only).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resumerge.errors import ResumergeError
from resumerge.runs.moe.passproc import CHECKED_LINE, JOB_GIVEN

# Seconds between two looks at the parent, where the kernel cannot be asked to signal its death.
_WATCH_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1


def follow_parent(parent: int) -> None:
    """Die (SIGKILL) as soon as process ``parent`` is gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCH_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent:  # the parent died before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def answer(job: dict[str, Any], workdir: Path, checked: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Do ``job`` and return what the parent needs back; ``checked`` is called once the pass (a ``routers`` job)
    has made every check it makes before its first weight."""
    from resumerge.runs.moe.prompts import encode, load_tokenizer

    mode = job["mode"]
    if job["job"] == "encode":
        tokenizer = load_tokenizer(Path(job["tokenizer_dir"]), mode)
        return {"encoded": [(encode(tokenizer, positive), encode(tokenizer, negative) if negative else None)
                            for positive, negative in job["prompts"]]}
    from resumerge.runs.moe.forward import InThisProcess, Weights, hidden_routers, pass_checks

    # plan's probe and the run's pass make the same checks, through the same function.
    ready = pass_checks(Path(job["weights_dir"]), Path(job.get("tokenizer_dir", job["weights_dir"])), mode,
                        job.get("prompts", ()))
    if job["job"] == "probe":
        return _probe()
    from resumerge.machine.memory.allocator import tune_allocator

    # As in the run's process: each layer's freed weights go back to the OS at once instead of staying in a heap
    # whose thresholds glibc raised, so this process holds what its share counts (one layer), not two. This
    # process ends with the pass: nothing to restore.
    tune_allocator()

    if job.get("threads"):
        import torch

        torch.set_num_threads(int(job["threads"]))
    weights = Weights(directory=Path(job["weights_dir"]),
                      tensors={name: (f, s, e, d, tuple(shape)) for name, (f, s, e, d, shape)
                               in job["tensors"].items()})
    site = InThisProcess(weights, mode, config_doc=job.get("config"), share=job.get("share"),
                         counted_elsewhere=job.get("parent_bytes", 0), ready=ready, on_checked=checked)
    hidden_routers(site, ready.sets, workdir, run_pid=int(job["parent"]), locks=Path(job["locks"]))
    return {"routers": str(workdir)}


def _probe() -> dict[str, Any]:
    """What this process holds and how long it took to get there (wall and CPU seconds) once the pass's checks
    are made: its code loaded, the base's modules built without weights, its tokenizer loaded and the prompts
    encoded (``plan``'s estimate of the pass)."""
    import psutil

    from resumerge.machine.memory import SystemProbe

    process = psutil.Process()
    cpu = process.cpu_times()
    return {"counted": SystemProbe().rss(), "rss": int(process.memory_info().rss),
            "seconds": time.time() - process.create_time(), "cpu_seconds": cpu.user + cpu.system}


def _say_checked() -> None:
    """Tell the run's process that the pass made its checks (:data:`~resumerge.runs.moe.passproc.CHECKED_LINE`)."""
    sys.stdout.write(CHECKED_LINE + "\n")
    sys.stdout.flush()


def _error_doc(error: ResumergeError) -> dict[str, Any]:
    return {"class": type(error).__name__, "message": error.message, "hint": error.hint, "path": error.path,
            "yaml_path": error.yaml_path, "tensor": error.tensor}


def _preload() -> None:
    """Load what every job needs (transformers' lazy modules included) while the run's process plans: an import
    that fails is reported by the job, as one line."""
    with contextlib.suppress(Exception):
        import torch  # noqa: F401
        import transformers

        for name in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "DynamicCache"):
            getattr(transformers, name)
        import transformers.masking_utils


def _models(text: str) -> bool:
    """Whether the job ``text`` runs the base model (a pass, or ``plan``'s probe of one, which measures the process
    a pass's is): only then are torch's and transformers' modelling modules loaded up front. Tokenising the prompts
    (``cheap_embed``, a pass placed on other nodes) needs only the tokenizer: the rest is 1.5-2 CPU s of imports
    (torch.distributed, sympy, dynamo) on the path of a run's planning, which waits for the tokens."""
    return bool(text) and json.loads(text).get("job") != "encode"


def main() -> int:
    """The entry point: load, read the job, do it, print the answer (started with its job,
    :data:`~resumerge.runs.moe.passproc.JOB_GIVEN`: read the job, load what it needs, do it)."""
    follow_parent(int(sys.argv[1]))
    text = sys.stdin.read() if JOB_GIVEN in sys.argv[2:] else None
    if text is None or _models(text):
        _preload()
    if text is None:
        text = sys.stdin.read()
    if not text:  # the run needed no pass after all (or ended): nothing to do
        return 0
    job = json.loads(text)
    try:
        result: dict[str, Any] = {"ok": answer(job, Path(job["workdir"]), _say_checked)}
    except ResumergeError as exc:
        result = {"error": _error_doc(exc)}
    except KeyboardInterrupt:  # Ctrl-C reaches the run's process too, which says it was interrupted
        return 130
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # The run waits for this process's end (its output's end of file): skip the interpreter's teardown of torch
    # and transformers, about a second; everything written is closed and, for the pass, fsynced already.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
