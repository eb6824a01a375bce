"""mergekit 0.1.5, the differential tests' oracle, as one long-lived process per test worker.

Importing mergekit (transformers, pydantic, its method registry) takes several seconds, more than most merges the
tests compare; one ``mergekit-yaml`` process per comparison paid it every time. This process imports it once and
runs each command line it is sent through ``mergekit-yaml``'s own click command (or another mergekit script's, such
as ``mergekit-extract-lora``'s), which applies the global options (the random seed, logging) on every call as a
fresh process does, with ``PYTHONHASHSEED=0`` as the tests' direct calls used. A command that fails answers its
exit code and traceback; a process that died is started again for the next command.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

_SERVER = r"""
import contextlib, importlib, io, json, sys, traceback

replies = sys.stdout
sys.stdout = sys.stderr  # mergekit's own prints must not mix with the replies
for line in sys.stdin:
    script, args = json.loads(line)
    err = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stderr(err):
            importlib.import_module(f"mergekit.scripts.{script}").main.main(args=args, standalone_mode=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    replies.write(json.dumps({"code": code, "stderr": err.getvalue()[-4000:]}) + "\n")
    replies.flush()
"""


def installed() -> bool:
    return shutil.which("mergekit-yaml") is not None


class Mergekit:
    """Runs ``mergekit-yaml ARGS`` in the shared oracle process; ``log`` takes what mergekit logs outside a call."""

    def __init__(self, log: Path) -> None:
        self._log = log
        self._proc: subprocess.Popen[str] | None = None

    def _process(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is not None:
            self.close()
        if self._proc is None:
            with open(self._log, "a") as log:
                self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=log, text=True,
                                              env={**os.environ, "PYTHONHASHSEED": "0"})
        return self._proc

    def run(self, *args: str | Path, timeout: float = 300,
            script: str = "run_yaml") -> subprocess.CompletedProcess[str]:
        """``mergekit-yaml ARGS`` (or the command of another module of ``mergekit.scripts``: ``extract_lora`` is
        ``mergekit-extract-lora``): the exit code and the stderr of the call (stdout is not kept)."""
        argv = [str(a) for a in args]
        proc = self._process()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([script, argv]) + "\n")
        proc.stdin.flush()
        # One reply per command, so nothing is buffered between calls and select sees the next line arrive.
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        reply = proc.stdout.readline() if ready else ""
        if not reply:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            return subprocess.CompletedProcess(["mergekit-yaml", *argv], proc.returncode or 1, "",
                                               f"the mergekit process died ({proc.returncode}); see {self._log}")
        answer = json.loads(reply)
        return subprocess.CompletedProcess(["mergekit-yaml", *argv], int(answer["code"]), "", str(answer["stderr"]))

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.kill()  # holds nothing to flush; its interpreter's teardown took seconds
        proc.wait()
        proc.stdout.close()
