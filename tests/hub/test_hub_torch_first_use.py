"""A hub run's downloads start before torch is imported: planning, the locks and OUT's checks need no tensor, and
torch's import (about 2 s of CPU) then overlaps the first bytes (:mod:`resumerge.machine.torch_import`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import write_config

from hub.conftest import REPO, SPEC
from hub.fakehub import FakeHub, sha256_of
from resumerge.cli.modelgen import make_model

# Runs in the merge's process: when torch is first imported, wait (up to 20 s, the import blocked meanwhile) for a
# weight file of the hub input (its blob is named by its sha256) to appear in the HF cache, partial or whole, and
# record what was seen. A run that imported torch before starting its downloads would wait in vain: its downloads
# start only after the import. (config.json and the tokenizer are fetched while planning: they do not count.)
_WATCH = """
import json, os, sys, time
from pathlib import Path
cache, record, weights = Path(os.environ["HF_HUB_CACHE"]), Path(sys.argv[1]), json.loads(sys.argv[2])

def blobs():
    return sorted(p.name for p in cache.glob("models--*/blobs/*") if p.name.split(".")[0] in weights)

class _WatchTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            deadline = time.monotonic() + 20
            while not blobs() and time.monotonic() < deadline:
                time.sleep(0.02)
            record.write_text(json.dumps(blobs()))
        return None

sys.meta_path.insert(0, _WatchTorch())
sys.argv = ["resumerge", *sys.argv[3:]]
from resumerge.cli.commands import entry
entry()
"""


# ties: the memory check sizes its row streams first; -j: the thread count waits for the import
@pytest.mark.parametrize(("method", "flags"), [("linear", []), ("ties", []), ("linear", ["-j", "1"])])
def test_the_downloads_start_before_torch_is_imported(tmp_path: Path, hub: FakeHub, method: str,
                                                      flags: list[str]) -> None:
    local = make_model(tmp_path / "local", SPEC, seed=7)
    cfg = write_config(tmp_path / "c.yml", {
        "merge_method": method,
        "base_model": str(local),
        "models": [{"model": REPO, "parameters": {"weight": 0.5, "density": 0.5}},
                   {"model": str(local), "parameters": {"weight": 0.5}}],
    })
    record = tmp_path / "seen.json"
    weights = [sha256_of(data) for name, data in hub.repos[REPO].commits[hub.repos[REPO].branches["main"]].items()
               if name.endswith(".safetensors")]
    assert weights
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(Path(__file__).parents[i]) for i in (1, 2))}
    command = ["run", str(cfg), str(tmp_path / "out"), "--state-dir", str(tmp_path / "state"), "--quiet", *flags]
    result = subprocess.run([sys.executable, "-c", _WATCH, str(record), json.dumps(weights), *command],
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(record.read_text()), "torch was imported before any download started"
    assert (tmp_path / "out" / "model.safetensors").exists() or any((tmp_path / "out").glob("*.safetensors"))
