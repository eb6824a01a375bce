"""A command a bench measures alone: a tiny launcher process forks and execs it, reaps it with ``wait4`` and prints
its exit code, its own peak RSS, the CPU seconds of it and of the descendants it waited for, and the I/O the kernel
credited to the launcher once it was reaped (the command's ``rchar``/``wchar``/``read_bytes``/``write_bytes``, plus a
few kB of the launcher's own). Linux keeps a process's pre-exec RSS high-water mark in ``ru_maxrss``, so a command
forked straight from a (torch-importing, model-generating) bench would report the bench's RSS. Shared by
``bench_linear``, ``bench_vs_mergekit`` and ``bench_kquant_route``."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_LAUNCHER = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "io = dict(line.split(': ') for line in open('/proc/self/io').read().splitlines())\n"
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime,\n"
    "      io['rchar'], io['wchar'], io['read_bytes'], io['write_bytes'])\n"
)


@dataclass(frozen=True)
class Launched:
    """One command run through the launcher: its figures and what it printed (the launcher's line last)."""

    code: int
    wall: float
    peak_rss: int  # bytes, the command's own process
    cpu: float  # user + system seconds of the command and its children
    rchar: int
    wchar: int
    read_bytes: int
    write_bytes: int
    stdout: str
    stderr: str


def launched(argv: list[str], env: dict[str, str] | None = None, *, cwd: Path | None = None,
             nice: bool = False) -> Launched:
    """Run ``argv`` through the launcher (``nice``: at niceness 19) in ``cwd`` with ``env``; exits with the stderr's
    tail when the launcher itself prints no figures."""
    start = time.monotonic()
    done = subprocess.run([*(["nice", "-n", "19"] if nice else []), sys.executable, "-c", _LAUNCHER, *argv],
                          env=env, capture_output=True, text=True, check=False, cwd=cwd)
    wall = time.monotonic() - start
    fields = done.stdout.split()[-7:]
    if len(fields) != 7 or not fields[0].lstrip("-").isdigit():
        raise SystemExit(f"{shlex.join(argv)}: the launcher printed no figures:\n{done.stderr[-3000:]}")
    code, peak, cpu, rchar, wchar, read_bytes, write_bytes = fields
    return Launched(int(code), wall, int(peak), float(cpu), int(rchar), int(wchar), int(read_bytes),
                    int(write_bytes), done.stdout, done.stderr)
