"""A plan and a run whose inputs and output are all local never import the hub's client: huggingface_hub and its
HTTP stack (httpx, httpcore, trio: about 0.3 s of CPU a command) load where a model or OUT is on the hub, never
else. One local plan and run in a fresh interpreter: a few seconds (torch's import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ModelFactory
from support import linear_config, write_config

# What a local run must not import: the hub client and its HTTP stack, and resumerge's modules over them (the hub
# inputs' resolution and transfers, the hub output).
LOCAL_RUN_NEVER_IMPORTS = ("huggingface_hub", "hf_xet", "httpx", "httpcore", "trio", "h11",
                           "resumerge.inputs.hub.resolve", "resumerge.inputs.hub.remote", "resumerge.inputs.hub.ranges",
                           "resumerge.inputs.hub.download", "resumerge.merge.engine.hubout",
                           "resumerge.merge.store.hubsink")


def test_a_local_plan_and_run_never_import_the_hub_client(tmp_path: Path, make: ModelFactory) -> None:
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    probe = (
        "import sys\n"
        "import contextlib, io\n"
        "from resumerge.cli.commands import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    planned = main(['plan', {str(cfg)!r}, {str(tmp_path / 'out')!r}, '--probe-size', '0'])\n"
        f"code = planned or main(['run', {str(cfg)!r}, {str(tmp_path / 'out')!r}, '--quiet'])\n"
        f"hub = sorted(m for m in sys.modules if m.startswith({LOCAL_RUN_NEVER_IMPORTS!r}))\n"
        "print(code, hub)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "0 []", done.stdout + done.stderr
    assert (tmp_path / "out" / "config.json").is_file()
