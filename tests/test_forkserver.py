"""The suite's fork server (tests/forkserver.py): a command forked from it is the fresh interpreter's command — the
same exit status, stdout and stderr, its own process that a kill point SIGKILLs — and a command whose environment
changes what the server imported before forking runs in a fresh interpreter instead."""

from __future__ import annotations

import os
import signal
import time
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
        # set in the test process by torch._dynamo's import (a transformers model run there, PEFT's import)
        assert server.forkable({**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
        assert not server.forkable({**env, "OMP_NUM_THREADS": "1"})  # libgomp read it as torch loaded
        assert not server.forkable({**env, "PYTHONPATH": "/elsewhere"})
    finally:
        server.close()
    assert server.process.returncode == 0


def test_a_started_command_is_signalled_by_its_pid_which_stays_its_own_until_its_status_is_read(
        tmp_path: Path) -> None:
    server = ForkServer()
    try:
        env = dict(os.environ)
        quick = server.start(["status", str(tmp_path / "nowhere"), "--json"], env, capture=True)
        assert quick is not None
        assert server.start(["--help"], env, capture=False) is None  # one at a time: the caller starts a fresh one
        deadline = time.monotonic() + 120
        while _state(quick.pid) != "Z":  # ended, not reaped: the number cannot go to another process meanwhile
            assert time.monotonic() < deadline, _state(quick.pid)
            time.sleep(0.01)
        quick.send_signal(signal.SIGKILL)  # reaches the zombie only
        fresh = cli("status", tmp_path / "nowhere", "--json", fresh=True)
        assert (quick.poll(), *quick.communicate()) == (fresh.returncode, fresh.stdout, fresh.stderr)
        assert not os.path.exists(f"/proc/{quick.pid}") or _state(quick.pid) != "Z"  # reaped once its status was read
        killed = server.start(["run", str(tmp_path / "nowhere.yml"), str(tmp_path / "out")], env, capture=False)
        assert killed is not None
        killed.kill()
        assert killed.wait(120) == -signal.SIGKILL and killed.communicate() == (None, None)
    finally:
        server.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
