"""No resumerge module imports torch when it is imported: torch (about 2 s of CPU) loads on first use, so a hub
run's downloads start before it (:mod:`resumerge.machine.torch_import`)."""

from __future__ import annotations

import operator
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from conftest import ModelFactory
from support import linear_config, write_config

import resumerge
from resumerge import api
from resumerge.analyses.estimate.costs import Estimate
from resumerge.analyses.estimate.memory import memory_estimate
from resumerge.analyses.estimate.torchside import TorchHere, TorchProcess
from resumerge.config.merge_config import load_config_text
from resumerge.errors import InterruptedMerge
from resumerge.machine import torch_import
from resumerge.machine.memory.fake import FakeProbe
from resumerge.merge.engine.devices import set_torch_threads
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.merge_plan import PlanOptions

_PACKAGE = Path(resumerge.__file__).parent


def _modules() -> list[str]:
    names = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        parts = path.relative_to(_PACKAGE.parent).with_suffix("").parts
        if parts[-1] in ("__main__",):
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


# Refuses torch in a fresh interpreter, so the traceback names the module that imported it.
_REFUSE_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported")
sys.meta_path.insert(0, _NoTorch())
"""


def _run(code: str) -> str:
    """What ``code`` printed, run in a fresh interpreter where importing torch fails."""
    result = subprocess.run([sys.executable, "-c", _REFUSE_TORCH + code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (torch allowed) and check it printed ``ok``."""
    result = subprocess.run([sys.executable, "-c", code + "print('ok')\n"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_importing_every_module_imports_no_torch() -> None:
    modules = _modules()
    assert "resumerge.merge.engine.executor" in modules and "resumerge.merge.methods.linear" in modules
    assert _run("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
                + "print('ok')") == "ok\n"


def test_the_method_registry_and_the_proxy_import_torch_only_when_a_tensor_is_made() -> None:
    code = (
        "from resumerge.merge.methods.registry import method_names, get_method\n"
        "from resumerge.machine.torch_import import torch\n"
        "import sys\n"
        "assert get_method('ties') is not None and 'linear' in method_names()\n"
        "from resumerge.inputs.tensorio import TORCH_DTYPES\n"
        "assert 'F32' in TORCH_DTYPES and 'F12' not in TORCH_DTYPES and len(TORCH_DTYPES) == 16\n"
        "assert 'torch' not in sys.modules\n"
        "t = torch.ones(2)\n"
        "import torch as real\n"
        "assert torch.Tensor is real.Tensor and isinstance(t, real.Tensor) and torch.__version__ == real.__version__\n"
    )
    _prints_ok(code)


def test_a_thread_count_waits_for_torch_and_the_newest_one_applies() -> None:
    """``-j``'s count is taken without importing torch (a hub run's downloads start first) and set before torch's
    first use; a newer count replaces one still waiting, None withdraws it, and once torch is loaded a count
    applies at once."""
    threads = ("import sys\nfrom resumerge.merge.engine.devices import set_torch_threads\n"
               "from resumerge.machine.torch_import import torch\n")
    _prints_ok(threads + (
        "set_torch_threads(3)\n"
        "set_torch_threads(1)\n"
        "assert 'torch' not in sys.modules\n"
        "torch.ones(2).sum()\n"
        "assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
        "set_torch_threads(2)\n"
        "assert torch.get_num_threads() == 2\n"
    ))
    _prints_ok(threads + (
        "set_torch_threads(1)\n"
        "set_torch_threads(None)\n"
        "import torch as real\n"
        "default = real.get_num_threads()\n"
        "torch.ones(2)\n"
        "assert torch.get_num_threads() == default, (torch.get_num_threads(), default)\n"
    ))


def test_torch_imported_beside_takes_the_waiting_thread_count_on_the_thread_that_uses_it() -> None:
    """A local run imports torch on a thread of its own while its proof reads the inputs; the thread count waiting
    for torch is set by the first use, on the thread that computes (OpenMP keeps one count a thread), not by the
    import's thread."""
    _prints_ok("import sys\nfrom resumerge.merge.engine.devices import set_torch_threads\n"
               "from resumerge.machine.torch_import import load_beside, torch\n"
               "set_torch_threads(1)\n"
               "thread = load_beside()\n"
               "assert thread is not None and thread.name == 'resumerge-torch-import'\n"
               "thread.join()\n"
               "import torch as real\n"
               "assert 'torch' in sys.modules and load_beside() is None\n"
               "torch.ones(2).sum()\n"
               "assert torch.get_num_threads() == 1, torch.get_num_threads()\n")


# Builds the plan of sys.argv[1] (a config) and its governor under each budget of sys.argv[2:] in turn; prints, for
# each, the error it raised if any and whether torch was imported by then (once it was, every later line says so:
# the first True names the budget whose check imported it).
_GOVERN = """
import sys
from resumerge.config.merge_config import load_config_text
from resumerge.merge.engine.drive import make_governor
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.merge_plan import PlanOptions
plan = plan_from_config(load_config_text(open(sys.argv[1]).read()), PlanOptions())
for budget in sys.argv[2:]:
    try:
        make_governor(plan, int(budget))
    except Exception as exc:
        print(type(exc).__name__, end=' ')
    print('torch' in sys.modules)
"""


def test_a_budget_near_what_a_tensor_needs_is_checked_with_torch_imported(tmp_path: Path,
                                                                         make: ModelFactory) -> None:
    """torch adds ~128 MB to the process (~250 MB with its mapped libraries, which the budget counts): the memory
    check counts it through a fresh process's baseline (measured once, in a process of its own) without importing it
    here, so a hub run's first download still comes before the import, and a budget the merge, torch loaded,
    cannot keep is refused (issue 71)."""
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))

    # One interpreter for the three budgets (each its own start: ~0.8 CPU s more apiece), torch looked for after each.
    budgets = (64 << 30, 150 << 20, torch_import.IMPORT_RESERVE)
    result = subprocess.run([sys.executable, "-c", _GOVERN, str(cfg), *map(str, budgets)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    far, near_torch, near = result.stdout.splitlines()
    assert far == "False"  # far from the need: torch still waits for the first tensor
    # Above what the interpreter holds before torch, below what it holds after: refused, torch counted.
    assert near_torch == "UsageError False"
    assert near == "False"  # near: it fits, torch counted and not imported


# Estimates sys.argv[1] (refused: a model folder is missing) then sys.argv[2] into sys.argv[3] with one torch thread
# as `resumerge plan` does (a fresh process), where this process may not import torch; prints how many child
# processes were left after each, whether the sample was timed, whether the counted baseline holds torch's memory
# (about 128 MB) beyond this process's own, torch-less, reading, and the working set and largest unit.
_APART = """
import sys, psutil
from resumerge import api
from resumerge.errors import InputError
from resumerge.machine.memory import SystemProbe
try:
    api.estimate(sys.argv[1], sys.argv[3], fresh_process=True, probe_size=0)
except InputError:
    pass
left = len(psutil.Process().children())
one = api.Settings(resources=api.Resources(num_threads=1))
est = api.estimate(sys.argv[2], sys.argv[3], one, fresh_process=True, probe_size=0)
groups = est.time.compute
print(left, len(psutil.Process().children()), bool(groups) and all(g.seconds_per_element for g in groups),
      est.memory.counted_baseline_bytes - SystemProbe().rss() > 50 << 20, est.memory.working_set_bytes,
      est.memory.largest_unit_bytes)
"""


def test_plan_imports_torch_and_times_the_sample_in_a_helper_that_a_refusal_does_not_leave_behind(
        tmp_path: Path, make: ModelFactory) -> None:
    """``resumerge plan`` imports torch in a helper process that overlaps planning and times the sample there: the
    planning process never imports it, yet the sample is timed and torch's memory is in the baseline; a refusal
    (exit 2) kills the helper in the middle of its import, and a finished plan leaves none either. Karcher's
    scratch on bfloat16 tensors grows with torch's threads: the planning process sizes it with the helper's
    count (``-j``), as an estimate made in one process does."""
    spec = {"layers": 1, "hidden": 64, "intermediate": 128, "vocab": 128, "dtype": torch.bfloat16}
    a, b = make("a", seed=1, **spec), make("b", seed=2, **spec)  # tensors of 8192 entries: a half dot's scratch
    good = write_config(tmp_path / "c.yml", {"merge_method": "karcher", "models": [{"model": str(a)},
                                                                                     {"model": str(b)}]})
    bad = write_config(tmp_path / "bad.yml", linear_config(a, tmp_path / "missing"))
    result = subprocess.run([sys.executable, "-c", _REFUSE_TORCH + _APART, str(bad), str(good),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.split()
    assert printed[:4] == ["0", "0", "True", "True"]
    threads = torch.get_num_threads()
    try:
        here = api.estimate(good, tmp_path / "out", probe_size=0,
                            settings=api.Settings(resources=api.Resources(num_threads=1)))
    finally:
        set_torch_threads(threads)
    assert isinstance(here, Estimate)
    assert printed[4:] == [str(here.memory.working_set_bytes), str(here.memory.largest_unit_bytes)]


def test_a_helper_that_is_gone_leaves_its_calls_to_this_process() -> None:
    """A helper that could not start or died (killed here before its first message) is not waited for: the calls
    run in this process, and torch's facts are this process's own (its memory readings already hold torch)."""
    side = TorchProcess(None)
    side.close()
    facts = side.facts()
    assert side.call(operator.add, 2, 3) == 5
    assert (facts.anon_bytes, facts.rss_bytes, facts.threads) == (0, 0, torch.get_num_threads())


def _interrupted() -> None:
    raise InterruptedMerge("stopped", resume_command="resumerge run c.yml out")


def test_a_helper_raises_what_it_raised_and_gives_its_memory_back_to_the_budget(tmp_path: Path,
                                                                               make: ModelFactory) -> None:
    """An exception the helper cannot send back as itself (its ``__init__`` takes a keyword-only argument) is
    raised here as itself: the call runs here. The helper reports the anonymous memory it holds (what the machine's
    available memory lacks while it lives), and ``plan``'s default budget and machine memory count it as
    available, as the run (which has no helper) will find it: the same figures as an estimate made with torch in
    this process."""
    a, b = make("a", seed=1), make("b", seed=2)
    plan = plan_from_config(load_config_text(write_config(tmp_path / "c.yml", linear_config(a, b)).read_text()),
                            PlanOptions())
    side = TorchProcess(None)
    try:
        facts = side.facts()
        (helper,) = [c for c in psutil.Process().children() if "torchside import serve" in " ".join(c.cmdline())]
        held = helper.memory_info()
        with pytest.raises(InterruptedMerge, match="stopped"):
            side.call(_interrupted)
        # A call sent ahead runs there while this process goes on; the answers keep their calls' order.
        sent = side.submit(operator.add, 2, 3)
        assert side.call(operator.mul, 4, 5) == 20 and sent() == 5 and sent() == 5
        failing = side.submit(_interrupted)
        assert side.submit(operator.sub, 9, 2)() == 7
        with pytest.raises(InterruptedMerge, match="stopped"):
            failing()
    finally:
        side.close()
    # Its interpreter and torch (~150 MB), as read from outside: RSS less file-backed pages (mapped libraries).
    assert facts.helper_bytes > facts.anon_bytes > 100 << 20
    assert abs(facts.helper_bytes - (held.rss - held.shared)) < 8 << 20, (facts.helper_bytes, held)
    # A 16 GB machine, this process holding 300 MB and others 2 GB: torch's memory in this process, or in the helper.
    machine, ours, others = 16 << 30, 300 << 20, 2 << 30
    in_process = FakeProbe(rss=ours + facts.anon_bytes, available=machine - ours - facts.anon_bytes - others)
    apart = FakeProbe(rss=ours, available=machine - ours - facts.helper_bytes - others)
    here, _ = memory_estimate(plan, plan.shards, in_process, None, 2, frozenset(), TorchHere().facts())
    there, _ = memory_estimate(plan, plan.shards, apart, None, 2, frozenset(), facts)
    assert (there.budget, there.machine_bytes, there.counted_baseline_bytes) == (
        here.budget, here.machine_bytes, here.counted_baseline_bytes)
