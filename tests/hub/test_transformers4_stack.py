"""The hub suite's core against the oldest huggingface_hub that pyproject.toml accepts (0.34.0: transformers 4.x
pins ``huggingface-hub>=0.34.0,<1.0``, so installing resumerge into a transformers-4 environment must leave that
line alone, and resumerge must work on it).

pip installs that version into a cached ``--target`` folder (once per machine), and the core hub tests run in a
subprocess with the folder first on ``PYTHONPATH``. Skipped only when pip cannot reach a package index.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

OLDEST = "0.34.0"
# What 0.34 needs beyond what resumerge's own install brings (module name, requirement), installed beside it
# only where the running environment lacks it.
NEEDS = (("requests", "requests"), ("fsspec", "fsspec>=2023.5.0"), ("tqdm", "tqdm>=4.42.1"),
         ("filelock", "filelock"), ("packaging", "packaging>=20.9"), ("typing_extensions", "typing-extensions"))
# The core: identifying repos and revisions, the checks and records, a merge from the hub, resume offline,
# landing downloads, .bin-only repos. Drops mid-download and hf:// outputs differ on 0.x (CHANGELOG, 0.x line).
CORE = ("test_hub_checks.py", "test_hub_merge.py", "test_hub_bin.py", "test_hub_landing.py")
_OFFLINE = re.compile(r"No matching distribution|Could not find a version|NewConnectionError|Network is "
                      r"unreachable|Temporary failure in name resolution|ProxyError|ConnectTimeout", re.I)


def _installed(target: Path) -> Path:
    """``huggingface_hub==OLDEST`` (and what it needs that is missing here) in ``target``, installed once."""
    if (target / "huggingface_hub").is_dir():
        return target
    building = target.with_name(f"{target.name}.{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    missing = [req for module, req in NEEDS if importlib.util.find_spec(module) is None]
    for args in ([f"huggingface_hub=={OLDEST}", "--no-deps"], missing):
        if not args:
            continue
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--target", str(building), *args], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            shutil.rmtree(building, ignore_errors=True)
            if _OFFLINE.search(done.stdout + done.stderr):
                pytest.skip(f"pip cannot reach a package index to install huggingface_hub=={OLDEST}")
            raise AssertionError(f"pip install failed:\n{done.stdout}\n{done.stderr}")
    try:
        building.rename(target)
    except OSError:  # another worker installed it meanwhile
        shutil.rmtree(building, ignore_errors=True)
    return target


@pytest.mark.slow
def test_the_hub_core_passes_on_the_oldest_supported_huggingface_hub() -> None:
    target = _installed(Path(tempfile.gettempdir()) / f"resumerge-tests-huggingface_hub-{OLDEST}")
    tests = Path(__file__).resolve().parent
    root = tests.parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), str(root), env.get("PYTHONPATH")) if p)
    version = subprocess.run([sys.executable, "-c", "import huggingface_hub; print(huggingface_hub.__version__)"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert version == OLDEST
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:randomly", "-p",
                           "no:cacheprovider", *(str(tests / name) for name in CORE)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout) and " skipped" not in done.stdout.splitlines()[-1]
