"""Shared fixtures: hermetic environment (state dir, HF cache, no network) and tiny generated models."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

# Libraries that fix their cache paths as they are first imported (datasets' HF_DATASETS_CACHE, trackio's store,
# both from HF_HOME) are imported while the test modules are collected, before `hermetic` points HF_HOME at a test's
# temp dir: they wrote the user's ~/.cache/huggingface. The session has an HF home of its own from the start.
SESSION_HF_HOME = tempfile.mkdtemp(prefix="resumerge-tests-hf-")
os.environ["HF_HOME"] = SESSION_HF_HOME
atexit.register(shutil.rmtree, SESSION_HF_HOME, True)
# Likewise resumerge's state dir: a module-scoped fixture's run (made before any test's `hermetic`) kept its ledger
# and checkpoints in the user's ~/.local/state/resumerge. The session's caches: see `session_caches`.
SESSION_STATE = tempfile.mkdtemp(prefix="resumerge-tests-state-")
os.environ["RESUMERGE_STATE_DIR"] = str(Path(SESSION_STATE) / "state")
os.environ["XDG_STATE_HOME"] = str(Path(SESSION_STATE) / "xdg-state")
atexit.register(shutil.rmtree, SESSION_STATE, True)

# A suite started as a background job (`pytest … &` in a script) inherits SIGINT ignored, and so does every command
# it starts: the Ctrl-C tests then saw a run that never stops (exit 6, or 0, where 3 is right). The commands are
# tested as a terminal starts them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# torch's OpenMP threads sleep between kernels instead of spinning (read once, as torch loads: before any import of
# it here), in the test workers and every interpreter they start, as in the fork servers' commands (which set it for
# themselves) and resumerge's own check: two workers of two threads each on a two-core machine spun on the cores the
# other needed. The wait policy changes no result (torch splits its work by the thread count, not by how its threads
# wait); a user's own setting stays. test_streamgen's in-process tests under load: 7.4 -> 1.3 and 3.8 -> 1.3 CPU
# s; the census's rows half their CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import forkserver  # noqa: E402  (after HF_HOME: its session environment is recorded as it is imported)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mergekit_oracle import Mergekit, installed  # noqa: E402
from raycluster import RayHead  # noqa: E402

from resumerge.cli.modelgen import ModelSpec, make_model  # noqa: E402

RAY_HEAD = pytest.StashKey[RayHead]()
DISCARD = pytest.StashKey[Path]()  # the base temp dir a session with no failure removes as it ends
COMMANDS = pytest.StashKey[Counter[str]]()  # the workers' tallies of CLI commands (forkserver.TALLY), merged
RAY_MODULES = pytest.StashKey[set[Path]]()  # the test modules with a test on Ray
# Ray's driver sets PYTHONBREAKPOINT as it connects (ray.init in the test process, the Ray modules, run first); each
# test starts with it as the session did. The variables a fork server reads as it starts are put back by
# forkserver.session_environment (scikit-learn's KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK, set by its import,
# wandb's WANDB_SERVICE, set as lm-eval's W&B logging starts its service in this process, a test's leftovers).
BREAKPOINT_SET = os.environ.get("PYTHONBREAKPOINT")


def pytest_configure() -> None:
    """Let this process keep the test modules' rewritten bytecode too (see ``bytecode_kept``). pytest caches each
    test module with its asserts rewritten unless ``sys.dont_write_bytecode`` is set; with it set, every worker
    parsed and rewrote all ~160 test modules on every run (a collection took 19 CPU seconds instead of 11)."""
    sys.dont_write_bytecode = False
    if log := os.environ.get("RESUMERGE_TEST_FORKLOG"):
        _log_interpreters(log)


def _log_interpreters(log: str) -> None:
    """Under RESUMERGE_TEST_FORKLOG, one JSON line for every Python interpreter this worker starts other than
    through :func:`support.cli` (which logs its own): a test's ``subprocess.run([sys.executable, ...])``, the
    mergekit oracle, a notebook's kernel, the fork server itself. Each imports what it needs afresh (torch: 2-5 CPU
    s); the suite's CPU goes where these go. Ray's workers are started by its raylet, not here, and are not counted."""
    import subprocess

    started = subprocess.Popen.__init__

    def logged(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(a) for a in ([args] if isinstance(args, (str, Path)) else args)]
        if argv and Path(argv[0]).name.startswith("python") and not _caller().startswith("support.py:"):
            what = next((a for a in argv[1:] if not a.startswith("-")), "")
            what = "fork server" if argv[1:2] == ["-c"] and "forkserver_child" in what else what[:80]
            with open(log, "a", encoding="utf-8") as out:
                out.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
                                      "kind": "python", "command": what, "forked": False,
                                      "why": "started by " + _caller()}) + "\n")
        started(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = logged  # type: ignore[method-assign]


def _caller() -> str:
    """The first frame outside subprocess and this file that started a process: file name and line."""
    frame = sys._getframe(2)
    while frame and (frame.f_code.co_filename.endswith(("subprocess.py", "conftest.py"))):
        frame = frame.f_back  # type: ignore[assignment]
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}" if frame else "?"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run first the modules that hold a test marked ``slow``, each module's tests kept together (so a
    module-scoped fixture is still built once) and in collection order otherwise. Under ``--dist worksteal``
    a worker that runs dry steals from the end of the other's queue, so the long tests must sit at the front:
    then both workers end on short tests, instead of one finishing a long kill or oracle test while the other
    waits. Every worker computes the same order (xdist requires it): it depends on the collection only."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    on_ray = {item.path for item in items if "ray_head" in getattr(item, "fixturenames", ())}
    spare = {item.path for item in items if getattr(getattr(item, "module", None), "RAY_SPARE_NODES", False)}
    config.stash[RAY_MODULES] = on_ray
    # The Ray modules (all slow) side by side, first: a worker runs them on one Ray head (see ``ray_head``); those
    # whose tests take spare worker nodes (tests/raycluster.py) before the others, so that each takes the nodes, and
    # the kept workers on them, that the one before left.
    items.sort(key=lambda item: (item.path not in slow, item.path not in on_ray, item.path not in spare))


@pytest.fixture(scope="session", autouse=True)
def bytecode_kept() -> Iterator[None]:
    """Let the suite's CLI subprocesses keep compiled bytecode. With PYTHONDONTWRITEBYTECODE set (as some CI and
    container images do), every ``python -m resumerge`` of the several hundred the suite starts compiled the whole
    package again (0.3-0.5 s each); written as usual (``__pycache__``, git-ignored), only the first one compiles."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
        yield


class _PlainMaps(ModuleType):
    """numpy as gguf-py's reader sees it (the tests' GGUF oracle: resumerge never uses it), but for ``memmap``, which
    hands back the file's map as a plain ndarray view of the same pages. The reader slices its map once per value
    (SmolLM2's 49,152 tokens and 48,900 merges: ~2 million slices a parse), and each slice of a ``memmap`` runs that
    subclass's Python ``__getitem__`` and ``__array_finalize__``: a parse of a SmolLM2-sized GGUF took ~3 CPU s, now
    ~1.8, the same values from the same bytes (a view of the map keeps it open, and read-only where it was)."""

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    @staticmethod
    def memmap(*args: object, **kwargs: object) -> object:
        return np.memmap(*args, **kwargs).view(np.ndarray)  # type: ignore[call-overload]


@pytest.fixture(scope="session", autouse=True)
def gguf_reads_plain_arrays() -> Iterator[None]:
    """gguf-py's ``GGUFReader``, wherever a test or transformers' GGUF loader builds one, reads through
    :class:`_PlainMaps` (where gguf-py is installed)."""
    try:
        import gguf.gguf_reader
    except ImportError:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.gguf_reader, "np", _PlainMaps("numpy"))
        yield


def _copied(value: Any) -> Any:
    """A copy of a parsed YAML document, every dict and list new (what a parse gives each caller)."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return value


def _shared_index(kept: Path, built: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The index pickled at ``kept`` (a file of the run's shared installation cache) by a worker that built it, or
    ``built()`` kept there (written whole, then renamed: a worker reads a whole file or none). lm-eval's version is
    in the name, and the run's own folder is new for each run: what one run kept never reaches another."""
    import pickle

    from lm_eval import __version__

    kept = kept.with_name(f"{kept.stem}-{__version__}{kept.suffix}")
    try:
        return dict(pickle.loads(kept.read_bytes()))
    except (OSError, pickle.UnpicklingError, EOFError):
        pass
    index = built()
    partial = kept.with_name(f"{kept.name}.{os.getpid()}")
    partial.write_bytes(pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(partial, kept)
    return index


@pytest.fixture(scope="session", autouse=True)
def lm_eval_tasks_parsed_once(installation_cache: Path) -> Iterator[None]:
    """lm-eval's own task YAMLs (~14,700 files of its installed package, unchanged while the session runs) parsed
    once per worker, not once per ``TaskManager`` that indexes them: each of lm-eval's command lines the tests run in
    this process (the door's, its ``hf`` oracle's) and each evaluation that looks a task up among lm-eval's builds
    one, 15-20 CPU s of YAML parsing each (a rebuild from the kept parses: 1.4). Every index still gets its own copy of
    each document, and a test's own ``include_path`` is read from its files each time. The index of lm-eval's own
    folder (what a ``TaskManager`` with its defaults builds first, each folder's entries apart from the next's, then
    laid over it) is kept too: a rebuild from the kept parses still walked the 14,000 files and copied each document
    (~1 CPU s a ``TaskManager``); lm-eval reads an entry's document only through a deep copy (its task factory), and
    no entry is changed once its folder is indexed (its parses are dropped once it is kept: it holds them, ~90 MB).
    The first worker to build it keeps it in the run's shared
    ``installation_cache`` (:func:`_shared_index`): the other reads it there (~0.8 CPU s, not the ~10 of the build).
    Where lm-eval was not imported by the collection (a run of modules that do not use it) nothing is imported
    here."""
    if "lm_eval" not in sys.modules:
        yield
        return
    import lm_eval.tasks._index as index

    own, parse, build = Path(index.__file__).parent, index.load_yaml, index.TaskIndex.build
    parsed: dict[tuple[Any, ...], Any] = {}
    indexed: dict[bool, dict[str, Any]] = {}

    def kept_index(paths: Any, *, resolve_includes: bool = True) -> dict[str, Any]:
        paths = list(paths)
        if not paths or Path(paths[0]) != own:
            return build(paths, resolve_includes=resolve_includes)
        if resolve_includes not in indexed:
            indexed[resolve_includes] = _shared_index(
                installation_cache / f"lm-eval-index-{resolve_includes}.pickle",
                lambda: build(paths[:1], resolve_includes=resolve_includes))
            for key in [k for k in parsed if ("resolve_func", False) in k[2]]:  # the index holds them now (~90 MB)
                del parsed[key]
        found = dict(indexed[resolve_includes])
        for name, entry in build(paths[1:], resolve_includes=resolve_includes).items():
            if name in found:  # as lm-eval's build says it of a later folder's entry
                index.log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                  found[name].yaml_path)
            found[name] = entry
        return found

    def kept(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not Path(path).is_relative_to(own):
            return parse(path, *args, **kwargs)
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            try:
                parsed[key] = parse(path, *args, **kwargs)
            except Exception as exc:  # a file the index skips (its reason logged at debug): skipped each time
                parsed[key] = exc
        if isinstance(parsed[key], Exception):
            raise parsed[key].with_traceback(None)
        return _copied(parsed[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(index, "load_yaml", kept)
        mp.setattr(index.TaskIndex, "build", staticmethod(kept_index))
        yield


@pytest.fixture(scope="session", autouse=True)
def machine_described_once() -> Iterator[None]:
    """torch's description of the machine (``collect_env.get_pretty_env_info``: ``pip list`` in a fresh interpreter
    and a dozen other commands, 1.5-2 CPU s and seconds of waiting) taken once per worker: every lm-eval results
    object made in this process holds it (lm-eval's ``add_env_info``: its command lines, resumerge's evaluation),
    and the machine does not change while the session runs. Where torch was not imported by the collection, nothing
    is imported here."""
    if "torch" not in sys.modules:
        yield
        return
    import functools

    import torch.utils.collect_env as collect_env

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(collect_env, "get_pretty_env_info", functools.cache(collect_env.get_pretty_env_info))
        yield


@pytest.fixture(scope="session", autouse=True)
def session_caches(installation_cache: Path) -> Iterator[None]:
    """``$XDG_CACHE_HOME`` is the run's ``installation_cache`` from the session's start: a module-scoped fixture's
    run, made before its tests' ``hermetic``, measured and kept its memory baselines, GGUF tokenizers and
    transformers' facts in the user's ~/.cache/resumerge."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(installation_cache))
        yield


@pytest.fixture(scope="session")
def installation_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``$XDG_CACHE_HOME`` for the whole run: resumerge keeps its measurement of a fresh process's memory there
    (resumerge.machine.memory.baseline), which costs an import of torch in a child process once, not once per test, and
    the names of lm-eval's own tasks (analyses.evaluation.keptnames: lm-eval's whole task index built once). Under xdist
    the workers share it (the run's folder, beside each worker's own): each kept figure is written atomically, and
    a worker that finds one kept by the other measures nothing again."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "xdg-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="session")
def each_test_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder under the session's base temp dir that holds each test's ``tmp_path`` and its ``hermetic`` home:
    kept out of the base temp dir itself, whose every numbered ``mktemp`` lists it whole (pytest finds the next
    number by scanning its entries: with the ~2 folders a test left there, a worker's 2,000th test listed ~4,000
    entries for each of them, ~2 ms apiece and growing with the run)."""
    return tmp_path_factory.mktemp("each-test")


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest, each_test_folders: Path) -> Path:
    """pytest's ``tmp_path``, a new empty folder for each test named after it, made without a scan
    (``tempfile.mkdtemp``: a random suffix, not the next number; see ``each_test_folders``). A session with no
    failure removes them all as it ends (:func:`pytest_unconfigure`)."""
    name = re.sub(r"\W", "_", request.node.name)[:30]
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=each_test_folders))


@pytest.fixture(autouse=True)
def hermetic(each_test_folders: Path, monkeypatch: pytest.MonkeyPatch, installation_cache: Path,
             torch_threads: int | None) -> Iterator[None]:
    """Point every cache and the state dir at temp dirs; never touch the user's files or the network."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=each_test_folders))
    monkeypatch.setenv("XDG_CACHE_HOME", str(installation_cache))
    monkeypatch.setenv("RESUMERGE_STATE_DIR", str(home / "state"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "xdg-state"))  # for tests that unset the one above
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("RESUMERGE_KILL_AT", raising=False)
    forkserver.session_environment()
    if BREAKPOINT_SET is None:
        os.environ.pop("PYTHONBREAKPOINT", None)
    else:
        os.environ["PYTHONBREAKPOINT"] = BREAKPOINT_SET
    yield
    forkserver.settle_servers()  # a command the test left running or unreaped would keep its server busy
    torch = sys.modules.get("torch")
    if torch_threads is not None and torch is not None and torch.get_num_threads() != torch_threads:
        # A CLI command run in this process with -j 1 (support.cli_here) sets torch's thread count for the process;
        # every later in-process run of the worker then computed with one thread where its subprocesses used two:
        # an evolve kill test's uninterrupted search, run here, wrote other KL bits than its resumed one (seen in a
        # full run; a forward pass's figures depend on torch's thread count).
        torch.set_num_threads(torch_threads)


@pytest.fixture(scope="session")
def torch_threads() -> int | None:
    """torch's thread count in this worker before any test ran (None where the collection did not import torch)."""
    torch = sys.modules.get("torch")
    return None if torch is None else int(torch.get_num_threads())


ModelFactory = Callable[..., Path]


@pytest.fixture
def make(tmp_path: Path) -> ModelFactory:
    """Build a model under tmp_path/models/<name> from ModelSpec keyword arguments."""

    def build(name: str, *, seed: int = 0, **spec: object) -> Path:
        return make_model(tmp_path / "models" / name, ModelSpec(**spec), seed=seed)  # type: ignore[arg-type]

    return build


@pytest.fixture(scope="session")
def mergekit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mergekit]:
    """``mergekit-yaml`` 0.1.5 (the differential tests' oracle) in one process for this worker's whole session."""
    if not installed():
        pytest.skip("mergekit 0.1.5 is not installed (pip install -e '.[test]')")
    oracle = Mergekit(tmp_path_factory.mktemp("mergekit") / "mergekit.log")
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def ray_head(pytestconfig: pytest.Config) -> Iterator[RayHead]:
    """This worker's Ray head (tests/raycluster.py), shared by its Ray tests: each starts it where none runs."""
    head = pytestconfig.stash.setdefault(RAY_HEAD, RayHead())
    yield head
    head.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under RESUMERGE_TEST_CPULOG, one JSON line per test (setup, call and teardown): the CPU seconds of this
    worker, of the processes it reaped (fresh interpreters, the mergekit oracle, a Ray head it stopped) and of the
    commands its fork servers forked and reaped, each taken as the test ends minus as it began. Ray's worker
    processes count where their raylet is reaped (the test that stops the head); a process left running, nowhere.
    ``python bench/suite_cpu.py LOG`` sums them by file: where the suite's CPU goes, on any machine's load. Each
    line also has the test's wall seconds and its worker (``gw0``; ``main`` without xdist): a test whose wall is
    well over its CPU waited (a sleep, a poll, a lock, a core the other worker held), and the workers' wall sums
    show how unevenly the two ended. Under RESUMERGE_TEST_CGROUP (a cgroup v1 ``cpuacct`` folder the run was started
    in: ``mkdir /sys/fs/cgroup/cpuacct/NAME; echo $$ > .../NAME/cgroup.procs``) each line has ``group`` too: the CPU
    seconds of every process of that cgroup in the test's time, the ones no count above sees included (Ray's raylets,
    agents and worker processes, which their raylet reaps or nobody does). Under xdist it counts both workers' tests
    (and the other agents' nothing): measure with ``-n 0``."""
    log = os.environ.get("RESUMERGE_TEST_CPULOG")
    if not log:
        yield
        return
    import time

    began, started = _cpu_now(), time.monotonic()
    yield
    spent = {name: round(value - began[name], 3) for name, value in _cpu_now().items()}
    with open(log, "a", encoding="utf-8") as out:
        out.write(json.dumps({"test": item.nodeid, **spent, "wall": round(time.monotonic() - started, 3),
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")


def _cpu_now() -> dict[str, float]:
    """This process's CPU seconds, its reaped children's, and the fork servers' reaped children's."""
    import resource

    own, reaped = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    forked = 0.0
    for server in forkserver.servers():
        try:
            fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended and reaped: its children's time is in this process's reaped children's now
            continue
        forked += (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    now = {"self": own.ru_utime + own.ru_stime, "children": reaped.ru_utime + reaped.ru_stime, "forked": forked}
    if group := os.environ.get("RESUMERGE_TEST_CGROUP"):
        now["group"] = int(Path(group, "cpuacct.usage").read_text()) / 1e9
    return now


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its tally of CLI commands (forked, or why fresh) to the controller's summary; a session
    with no failure marks its base temp dir for removal as it ends (:func:`pytest_unconfigure`)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["commands"] = dict(forkserver.TALLY)
    folder = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    # pytest's own numbered folders only (an xdist worker's --basetemp is one, under the controller's)
    ours = any(part.startswith("pytest-of-") for part in folder.parts)
    if not session.testsfailed and ours and "RESUMERGE_KEEP_TMP" not in os.environ:
        session.config.stash[DISCARD] = folder


@pytest.hookimpl(optionalhook=True)  # xdist's hook
def pytest_testnodedown(node: Any, error: object) -> None:
    """The controller adds each worker's tally as the worker ends (``pytest_sessionfinish`` above)."""
    tally = node.config.stash.setdefault(COMMANDS, Counter())
    tally.update(getattr(node, "workeroutput", {}).get("commands", {}))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line on how the run's CLI commands started: forked from a worker's fork server, or a fresh interpreter
    (torch imported again: 2-5 CPU s each) and why. A full run that is minutes slower than the one before shows here
    whether its commands stopped being forked (a server that ended and was started again counts too)."""
    merged = config.stash.get(COMMANDS, None)  # the workers' (under xdist), else this process's own
    tally = merged if merged is not None else forkserver.TALLY
    if not tally:
        return
    fresh = sum(n for why, n in tally.items() if why not in ("forked", "server restarted"))
    reasons = ", ".join(f"{why}: {n}" for why, n in tally.most_common() if why != "forked")
    terminalreporter.write_line(f"CLI commands: {tally['forked']} forked from the fork servers, {fresh} fresh "
                                f"interpreters" + (f" ({reasons})" if reasons else ""))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Close the fork servers as the session ends: an xdist worker exits without its ``atexit`` functions. Then
    remove the session's base temp dir where no test failed (each test's ``tmp_path`` and ``hermetic`` home are made
    by this file's fixtures, which pytest's retention policy never removes: a full run left ~20 GB on the disk CI
    shares). Only once every test and fixture has ended: removing a passed test's folder at its own teardown made a
    full run fail in ways no single test did. A failed run keeps everything to look at; so does
    ``RESUMERGE_KEEP_TMP=1``, and a ``--basetemp`` the user chose is never removed."""
    forkserver.close_servers()
    if (folder := config.stash.get(DISCARD, None)) is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the Ray head once the next test is in a module without Ray tests (its idle processes cost ~2% of a core
    while the session goes on); a Ray test the worker is handed later starts it again. A test outside the Ray
    modules that left this process a Ray driver fails here."""
    head = item.config.stash.get(RAY_HEAD, None)
    if head is not None and (nextitem is None or nextitem.path not in item.config.stash.get(RAY_MODULES, set())):
        head.stop()
    ray = sys.modules.get("ray")
    if ray is not None and item.path not in item.config.stash.get(RAY_MODULES, set()) and ray.is_initialized():
        # A test without a Ray head that left this process a Ray driver (Ray starts a local cluster for a call that
        # needs one, ray.get_runtime_context() among them): the driver's error listener would write the raylet's
        # complaints into later tests' stderr (a CI run failed so, on a disk over 95% full), and its processes would
        # run on to the session's end.
        ray.shutdown()
        pytest.fail(f"{item.nodeid} left this process connected to a Ray cluster it started", pytrace=False)
