"""Build and configure the LD_PRELOAD fault shim (``faultshim.c``) that tests/test_faults.py runs merges under.

The shim is compiled at test time with the system C compiler into a temp dir; :func:`build_shim` raises
:class:`ShimUnavailable` (the tests then skip, saying why) when there is no compiler or the build fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("faultshim.c")


class ShimUnavailable(Exception):
    """The shim cannot be built or used here (no C compiler, not Linux/glibc)."""


def build_shim(directory: Path) -> Path:
    """Compile the shim into ``directory`` and return the shared library's path."""
    if not sys.platform.startswith("linux"):
        raise ShimUnavailable("the fault shim needs Linux (LD_PRELOAD with glibc symbol names)")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ShimUnavailable("no C compiler (cc/gcc) to build the fault shim")
    library = directory / "libfaultshim.so"
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE), "-ldl"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ShimUnavailable(f"building the fault shim failed: {done.stderr.strip()[-500:]}")
    return library


def probe_shim(library: Path, directory: Path) -> None:
    """Raise :class:`ShimUnavailable` unless a Python child under the shim really gets the injected error (the
    dynamic loader can ignore LD_PRELOAD, e.g. for a statically linked interpreter)."""
    target = directory / "probe" / "file"
    target.parent.mkdir(exist_ok=True)
    code = ("import errno, sys\ntry:\n    open(sys.argv[1], 'w')\nexcept OSError as e:\n"
            "    sys.exit(0 if e.errno == errno.EROFS else 3)\nsys.exit(4)\n")
    env = dict(os.environ, **shim_env(library, match=str(target.parent), ops="open", errno="EROFS"))
    done = subprocess.run([sys.executable, "-c", code, str(target)], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise ShimUnavailable(f"LD_PRELOAD fault shim has no effect here (probe exit {done.returncode}: "
                              f"{done.stderr.strip()[-300:]})")


def shim_env(library: Path, **settings: object) -> dict[str, str]:
    """Environment for a child process under the shim: ``match="/out/", ops="write", errno="ENOSPC"`` becomes
    ``FAULTSHIM_MATCH=/out/ FAULTSHIM_OPS=write FAULTSHIM_ERRNO=ENOSPC`` (see faultshim.c for every setting)."""
    env = {"LD_PRELOAD": str(library)}
    env.update({f"FAULTSHIM_{key.upper()}": str(value) for key, value in settings.items()})
    return env
