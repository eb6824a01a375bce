"""The suite's fork server (tests/forkserver.py): a command forked from it is the fresh interpreter's command — the
same exit status, stdout and stderr, its own process that a kill point SIGKILLs — and a command whose environment
changes what the server imported before forking runs in a fresh interpreter instead."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from forkserver import ForkServer
from support import cli, digests, linear_config, write_config

from resumerge.cli.modelgen import ModelSpec, make_model


def test_a_forked_command_is_the_fresh_interpreter_s_and_a_kill_point_kills_it(tmp_path: Path) -> None:
    spec = ModelSpec(layers=1, hidden=16, intermediate=32, vocab=32, tokenizer=False)
    a, b = make_model(tmp_path / "a", spec, seed=0), make_model(tmp_path / "b", spec, seed=1)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    server = ForkServer()
    try:
        env = dict(os.environ)
        for args in (["nonsense"], ["status", str(tmp_path / "nowhere"), "--json"]):
            forked, fresh = server.run(args, env, 120), cli(*args, fresh=True)
            assert forked is not None
            assert (forked.returncode, forked.stdout, forked.stderr) == (
                fresh.returncode, fresh.stdout, fresh.stderr), args
        for how in ("forked", "fresh"):
            args = ["run", str(config), str(tmp_path / how), "--state-dir", str(tmp_path / f"s-{how}"), "--quiet"]
            done = server.run(args, env, 120) if how == "forked" else cli(*args, fresh=True)
            assert done is not None and (done.returncode, done.stdout, done.stderr) == (0, "", ""), how
        assert digests(tmp_path / "forked") == digests(tmp_path / "fresh")
        killed = server.run(["run", str(config), str(tmp_path / "out"), "--state-dir", str(tmp_path / "s")],
                            {**env, "RESUMERGE_KILL_AT": "after_fsync"}, 120)
        assert killed is not None
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert server.forkable({**env, "RESUMERGE_KILL_AT": "after_fsync", "HF_HOME": "/elsewhere"})
        assert not server.forkable({**env, "OMP_NUM_THREADS": "1"})  # libgomp read it as torch loaded
        assert not server.forkable({**env, "PYTHONPATH": "/elsewhere"})
    finally:
        server.close()
    assert server.process.returncode == 0
