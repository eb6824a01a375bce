"""The suite's fork server (tests/forkserver.py): a command forked from it is the fresh interpreter's command — the
same exit status, stdout and stderr, its own process that a kill point SIGKILLs — and a command whose environment
changes what the server imported before forking runs in a fresh interpreter instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from forkserver import ForkServer
from support import cli, digests, linear_config, write_config

import resumerge
from resumerge.cli.modelgen import ModelSpec, make_model


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    """One server for the module's tests (each start imports torch and resumerge: ~2.6 CPU s), which ends cleanly
    once its requests close."""
    server = ForkServer()
    yield server
    server.close()
    assert server.process.returncode == 0


def test_a_forked_command_is_the_fresh_interpreter_s_and_a_kill_point_kills_it(server: ForkServer,
                                                                               tmp_path: Path) -> None:
    spec = ModelSpec(layers=1, hidden=16, intermediate=32, vocab=32, tokenizer=False)
    a, b = make_model(tmp_path / "a", spec, seed=0), make_model(tmp_path / "b", spec, seed=1)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
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
    # set in the test process by Ray's driver as it connects (ray.init): breakpoint() reads it as it is called
    assert server.forkable({**env, "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"})
    assert not server.forkable({**env, "OMP_NUM_THREADS": "1"})  # libgomp read it as torch loaded
    assert server.unforkable({**env, "OMP_NUM_THREADS": "1"}) == "env OMP_NUM_THREADS"  # the fork log's reason
    assert not server.forkable({**env, "PYTHONPATH": "/elsewhere"})
    # resumerge's run modules imported before the fork; nothing that reads the environment as it is imported
    assert "resumerge" in server._imported() and not {"huggingface_hub", "transformers"} & server._imported().keys()


def test_a_started_command_is_signalled_by_its_pid_which_stays_its_own_until_its_status_is_read(
        server: ForkServer, tmp_path: Path) -> None:
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


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


_LOOK = """
import json, resource, sys
import stand_in
print(json.dumps([sys.argv, sys.path, resource.getrlimit(resource.RLIMIT_FSIZE), stand_in.__file__]))
"""


def test_a_script_under_a_limit_with_folders_put_first_on_its_path_is_the_fresh_interpreter_s(
        server: ForkServer, tmp_path: Path) -> None:
    """``python SCRIPT ARGS`` under a resource limit, with a PYTHONPATH that puts a folder before the server's: the
    same argv, path, limit and imports forked as fresh; a folder holding a module the server imported is not
    forked from (the command would import that one)."""
    script, added = tmp_path / "bin" / "look.py", tmp_path / "site"
    script.parent.mkdir()
    script.write_text(_LOOK)
    added.mkdir()
    (added / "stand_in.py").write_text("")  # a module the command imports that the server never did
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(added), *filter(None, [os.environ.get("PYTHONPATH")])])}
    limits = {"RLIMIT_FSIZE": 123_456_789}
    assert server.forkable(env)
    forked = server.run(["a", "b c"], env, 120, script, limits)
    fresh = cli("a", "b c", env=env, fresh=True, script=script, limits=limits)
    assert forked is not None and forked.returncode == fresh.returncode == 0, (forked, fresh)
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr == ""
    argv, _, limit, imported = json.loads(forked.stdout)
    assert argv == [str(script), "a", "b c"] and limit == [123_456_789] * 2
    assert imported == str(added / "stand_in.py")
    # The repository's root first (a notebook's kernel): it holds the resumerge the server imported, and no other
    root = Path(resumerge.__file__).resolve().parents[1]
    assert server.forkable({**env, "PYTHONPATH": os.pathsep.join([str(root), env["PYTHONPATH"]])})
    (added / "torch").mkdir()  # the server imported torch: from here the command would import this one
    assert not server.forkable(env)
    assert not server.forkable({**env, "PYTHONPATH": str(tmp_path / "nowhere")})


def test_the_server_of_the_transformers_commands_forks_only_where_its_imports_read_the_command_s_values(
        tmp_path: Path) -> None:
    """``eval``, ``check`` and ``evolve`` (a test's own front end to them too) are forked from a server of their own,
    which imported what transformers imports but transformers (torch's dynamo, sympy, scipy: about 2 CPU s a
    command): a run-time variable one of those imports read (torch._dynamo: TORCHINDUCTOR_CACHE_DIR, which it sets
    where unset) is recorded, and a command whose value differs starts a fresh interpreter; one where it is unset
    sees it set as a fresh interpreter's import sets it."""
    import sys

    import forkserver
    from support import _imports_transformers

    assert _imports_transformers(("--spilled", "eval", "model")) and not _imports_transformers(("run", "eval"))
    plain = forkserver.worker_server()
    server = forkserver.worker_server(transformers=True)
    assert server is not plain and forkserver.worker_server(transformers=True) is server
    server._imported()
    assert not any(name.partition(".")[0] in {"transformers", "huggingface_hub"} for name in server._modules or {})
    assert "TORCHINDUCTOR_CACHE_DIR" in server._read_env
    # The server's environment may hold it already (the full suite's did: '/tmp/torchinductor_root', what the import
    # sets): the import sets it only where it was unset, and a command whose environment has it as the server read
    # it forks, as one without it does where the server's had none.
    read = server._read_env["TORCHINDUCTOR_CACHE_DIR"]
    assert ("TORCHINDUCTOR_CACHE_DIR" in server._set_env) == (read is None)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if read is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = read
    elsewhere = {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert plain.forkable(elsewhere)  # it never imported torch._dynamo
    assert server.unforkable(elsewhere) == "env read at import TORCHINDUCTOR_CACHE_DIR"
    assert server.forkable({**env, "TORCHINDUCTOR_CACHE_DIR": server._set_env.get("TORCHINDUCTOR_CACHE_DIR", read)})
    script = tmp_path / "front.py"
    script.write_text("import os, sys\nimport torch._dynamo.package as package\n"
                      "print(sorted(m for m in ('transformers', 'huggingface_hub') if m in sys.modules), "
                      "os.environ.get('TORCHINDUCTOR_CACHE_DIR'), package.DynamoCache._path_prefix, sys.argv[1:])\n")
    for env_now in (env, elsewhere):
        forked = server.run(["eval", "x"], env_now, 120, script) if server.forkable(env_now) else None
        fresh = subprocess.run([sys.executable, str(script), "eval", "x"], env=env_now, capture_output=True,
                               text=True, check=False)
        assert fresh.returncode == 0, fresh.stderr
        if env_now is env:
            assert forked is not None and (forked.returncode, forked.stdout, forked.stderr) == (
                fresh.returncode, fresh.stdout, fresh.stderr)
        else:
            assert forked is None and str(tmp_path / "inductor") in fresh.stdout


def test_what_a_test_or_a_library_leaves_set_never_keeps_later_commands_from_the_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable set in the test process as a library sets one (wandb's ``WANDB_SERVICE`` as lm-eval's W&B logging
    starts its service here) is gone again when the next test starts (conftest's ``hermetic`` calls
    ``session_environment``), and a worker's server starts with the session's environment whatever the test that
    first needs it has set: either left in it, every command of the worker's later tests differed from its server's
    environment and started a fresh interpreter (torch imported again) for the rest of the session."""
    from forkserver import SESSION_ENV, server_environment, session_environment

    server = ForkServer.__new__(ForkServer)  # its environment and its checks, no process started
    server.process = type("Running", (), {"poll": staticmethod(lambda: None)})()  # type: ignore[assignment]
    server.env, server._modules, server._said = server_environment(), {}, threading.Lock()
    os.environ["SUITE_LEFT_BY_A_LIBRARY"] = "/tmp/wandb-1/socket"  # as wandb.init sets WANDB_SERVICE (not restored)
    assert server.unforkable(dict(os.environ)) == "env SUITE_LEFT_BY_A_LIBRARY"
    session_environment()  # the next test's start
    assert "SUITE_LEFT_BY_A_LIBRARY" not in os.environ and server.forkable(dict(os.environ))
    assert server.forkable({**os.environ, "WANDB_MODE": "offline", "TRACKIO_DIR": "/elsewhere"})  # read in a command
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a test's own setting, which its commands start fresh with
    monkeypatch.setenv("RESUMERGE_SUITE_PROBE", "1")
    born = server_environment()
    assert born.get("OMP_NUM_THREADS") == SESSION_ENV.get("OMP_NUM_THREADS") and born["RESUMERGE_SUITE_PROBE"] == "1"


def test_a_command_its_test_never_waited_for_is_settled_as_the_test_ends(server: ForkServer,
                                                                        tmp_path: Path) -> None:
    """A started command whose status its test never read kept the server busy: every command of every later test
    of the worker started a fresh interpreter. Settled (killed where it still runs, reaped), the server forks again;
    one already read is left alone."""
    env = dict(os.environ)
    left = server.start(["status", str(tmp_path / "nowhere"), "--json"], env, capture=False)
    assert left is not None and server.start(["--help"], env, capture=False) is None  # busy
    assert server.settle() == left.args and left.returncode is not None
    done = server.start(["--help"], env, capture=False)
    assert done is not None
    done.wait(120)
    assert server.settle() is None


def test_a_server_that_ended_once_started_is_started_again_and_one_that_ended_as_it_started_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's server that ended (a test killed it, or the OOM killer) stayed in place: every later command of the
    worker's session started a fresh interpreter ("server ended"). It is started again, and counted; one that ended
    before it said what it imported (an ``LD_PRELOAD`` library without ``forkserver_child``) is not started again
    for each command. Stand-in servers: real processes, killed, without torch's import."""
    from collections import Counter

    import forkserver

    class Standin:
        def __init__(self, preload: str | None, env: dict[str, str], transformers: bool) -> None:
            self.process = subprocess.Popen(["sleep", "60"])
            self._modules: dict[str, str | None] | None = None

        def close(self) -> None:
            self.process.kill()
            self.process.wait()

    with monkeypatch.context() as mp:  # undone before conftest's teardown settles the servers
        mp.setattr(forkserver, "ForkServer", Standin)
        mp.setattr(forkserver, "_SERVERS", {})
        mp.setattr(forkserver, "TALLY", Counter())
        mp.setattr(forkserver.atexit, "register", lambda close: None)
        first = forkserver.worker_server("/suite/probe.so")
        first.close()  # ended as it started
        assert forkserver.worker_server("/suite/probe.so") is first and not forkserver.TALLY
        running = forkserver.worker_server()
        running._modules = {}  # it said what it imported
        running.process.kill()
        running.process.wait()
        again = forkserver.worker_server()
        assert again is not running and again.process.poll() is None and forkserver.worker_server() is again
        assert dict(forkserver.TALLY) == {"server restarted": 1}
        again.close()


def test_a_server_whose_reply_comes_too_late_is_ended_so_that_no_later_command_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's reply (the child's pid) that came after the caller gave up would be read as the next command's
    reply: the server is ended (and :func:`forkserver.worker_server` starts another). A stand-in server that says
    what it imported and never answers a request."""
    import sys

    server = ForkServer.__new__(ForkServer)
    server.process = subprocess.Popen(  # type: ignore[assignment]
        [sys.executable, "-c", "import time; print('{\"modules\": []}', flush=True); time.sleep(60)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    server.env, server._modules, server._read = dict(os.environ), None, b""
    server._said, server._busy, server._running = threading.Lock(), threading.Lock(), None
    server.folder = Path(os.devnull).parent  # unused: nothing is captured
    monkeypatch.setattr(server, "reply_seconds", 0.5)
    with pytest.raises(Exception, match="timed out"):
        server.start(["--help"], dict(os.environ), capture=False)
    assert server.process.wait(10) == -signal.SIGKILL
    assert server._busy.acquire(blocking=False)
    for pipe in (server.process.stdin, server.process.stdout):
        assert pipe is not None
        pipe.close()
