"""A job's thread count kept in its folder: decided once, as the job first starts, and read back by every process
that resumes it (a forward pass's, :mod:`resumerge.forward.job.threads`; a search's, in its STORAGE). Neither torch nor
numpy imported: ``status`` reads it, and must stay fast."""

from __future__ import annotations

import json
from pathlib import Path

from resumerge.config.params import is_whole
from resumerge.machine.durable import write_file_atomic

THREADS_FILE = "threads.json"  # {"threads": N}: the count the job computes with


def recorded_threads(folder: Path, name: str = THREADS_FILE) -> int | None:
    """The thread count recorded in ``folder`` (None: none yet, or a file that is not one: a job that never
    started, or an older resumerge's)."""
    try:
        count = json.loads((folder / name).read_text(encoding="utf-8"))["threads"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return count if is_whole(count) and count >= 1 else None


def decided_threads(folder: Path, name: str = THREADS_FILE) -> int:
    """The thread count of the job kept in ``folder``: the one recorded there, else torch's count now (``-j`` where
    the command set it, else the machine's), recorded durably before it is returned, so that nothing computed with
    it is journaled without it."""
    count = recorded_threads(folder, name)
    if count is not None:
        return count
    from resumerge.machine.torch_import import torch

    count = max(1, int(torch.get_num_threads()))
    folder.mkdir(parents=True, exist_ok=True)
    write_file_atomic(folder / name, json.dumps({"threads": count}).encode())
    return count


def threads_words(count: int) -> str:
    """``status``'s words for a job's recorded count."""
    return f"{count} torch thread{'s' if count != 1 else ''} (decided at its first start, kept on a resume)"


def threads_rows(count: int | None) -> tuple[tuple[str, str], ...]:
    """``status``'s row of a pass's recorded count (none where it has not started yet)."""
    return (("threads", threads_words(count)),) if count is not None else ()
