"""A GGUF run stays within the smallest ``--max-memory`` ``plan`` names (``--max-memory`` is a promise): its
encoders' compiled kernels (numba's runtime started and each type's kernel loaded: about 80 MB, which no import holds
and the governor reserves for no unit) are counted in the run's baseline, measured in a fresh process that loads
them; and a run with ``--imatrix-texts`` counts them beside the pass's modules, which stay in the process its merge
follows the pass in. Before, a K-quant run at ``plan``'s smallest budget peaked 17 % over it (424 MB under 362 MB
with ``--imatrix-texts``): each peak is a real process's, as the OS measured it (``ru_maxrss``), held to the budget
it ran under, which ``plan`` named with its 5 % margin."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ggufmodels import linear_llama_pair
from support import cli, peak_rss_run
from test_imatrix_merge import K_MIX, TEXTS

pytest.importorskip("numba")  # without it the encoders are numpy's: no kernels to count
# A release whose second file is an i-quant mix (IQ2_S, IQ3_S tensors: their tables built by its first tensors)
RELEASE = ("--out-type", "gguf", "--gguf-type", "q4_k_m,iq2_m")


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """test_imatrix_merge's tiny merge and texts, built for this module."""
    return linear_llama_pair(tmp_path_factory.mktemp("budget"), TEXTS)


@pytest.mark.parametrize(("mix", "texts"), [(K_MIX, False), (RELEASE, True)], ids=["k-quants", "imatrix-texts"])
def test_a_gguf_run_at_the_smallest_budget_plan_names_stays_within_it(
        merge: tuple[Path, Path], tmp_path: Path, mix: tuple[str, ...], texts: bool) -> None:
    """At ``plan``'s smallest budget the run finishes and its process's peak RSS is within that budget; a budget
    1 MB under it is refused by the run (exit 2) before anything is written. With a matrix, a release whose second
    file is an i-quant mix (IQ2_S, IQ3_S): the tables their first tensors build were held above the budget
    (tests/test_gguf_table_peaks.py)."""
    config, found = merge
    out, state = tmp_path / "out", tmp_path / "state"
    args = (config, out, "--state-dir", state, *mix, *(("--imatrix-texts", found) if texts else ()))
    planned = cli("plan", *args, "--json", timeout=600)
    assert planned.returncode == 0, planned.stderr
    smallest = json.loads(planned.stdout)["memory"]["smallest_budget"]
    refused = cli("run", *args, "--max-memory", f"{(smallest - 1_000_000) // 1000}kB", timeout=600)
    assert refused.returncode == 2, refused.stderr
    assert not out.exists()
    code, peak, err = peak_rss_run([sys.executable, "-m", "resumerge", "run", *map(str, args), "--max-memory",
                                    f"{smallest // 1000}kB"])
    assert code == 0, err
    assert peak <= smallest, (peak, smallest)


def test_every_k_quant_run_of_an_installation_reads_one_baseline_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's baseline is measured once per installation and set of kernels (a fresh process importing torch and
    numba, 4-6 CPU s): every set of K-quant and IQ4 kernels (IQ4_NL, IQ4_XS: K-quant mixes' fallbacks) is measured as
    all of them (any such set held 362.3-365.6 MB, bench/bench_kernel_baseline.py), never as fewer than the run
    loads; a set with another i-quant's or TQ's kernel is measured as it is (those sets' figures are not their
    kernels' sum)."""
    from types import SimpleNamespace
    from typing import cast

    from resumerge.merge.engine import footprint
    from resumerge.merge.plan.merge_plan import Plan

    asked: list[str] = []
    monkeypatch.setattr(footprint, "fresh_baseline", lambda modules, cache: asked.append(modules[-1]) or 1)
    specs = ("11,14", "12,13,14", "10w,11w,14", "14,20", "14w,23w", "12w,16w", "14,34")
    for spec in specs:
        monkeypatch.setattr(footprint, "kernel_spec", lambda plan, spec=spec: spec)
        footprint.run_baseline(cast(Plan, SimpleNamespace(tensors={})))
    loaded = [entry.rpartition(":")[2].split(",") for entry in asked]
    assert all(set(spec.split(",")) <= set(kernels) for spec, kernels in zip(specs, loaded, strict=True)), asked
    assert len(set(asked[:5])) == 1, asked
    assert asked[5].endswith(":12w,16w") and asked[6].endswith(":14,34"), asked


def test_a_release_s_kernels_are_compiled_once_split_by_family_over_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels a run's baselines load are compiled ahead into numba's disk cache once (27 CPU s for the 7-type
    release's, which both of its measurements with kernels compiled, at once, on a fresh runtime): each entry of
    the spec in one process, a family's entries (which share their kernels) in the same one, dealt over at most
    the machine's cores."""
    from types import SimpleNamespace
    from typing import cast

    from resumerge.merge.engine import footprint
    from resumerge.merge.plan.merge_plan import Plan
    from resumerge.outputs.gguf import jit
    from resumerge.outputs.gguf.encoders import kernel_family

    plan = cast(Plan, SimpleNamespace(tensors={}))
    spec = "12w,13w,14w,20w,21w,22w,23w"  # the 7-type release's (q8_0 ... iq2_m with a matrix)
    monkeypatch.setattr(footprint, "kernel_spec", lambda plan: spec)
    monkeypatch.setattr(jit, "on_disk", lambda modules: False)  # a fresh numba cache
    for cores in (1, 2, 3, 16):
        lists = footprint.compile_ahead(plan, cores)
        assert len(lists) == min(cores, 4) and all(len(each) == 1 for each in lists), lists
        groups = [each[0].rpartition(":")[2].split(",") for each in lists]
        assert sorted(e for group in groups for e in group) == spec.split(","), groups
        where = {kernel_family(int(e.rstrip("w"))): i for i, group in enumerate(groups) for e in group}
        assert all(where[kernel_family(int(e.rstrip("w")))] == i for i, group in enumerate(groups) for e in group)
    assert {kernel_family(t) for t in (12, 13, 14)} == {"resumerge.outputs.gguf.kquants"}
    assert kernel_family(22) != kernel_family(23)  # IQ2_S's kernels are iq2loop's, IQ4_XS's iqloop's
    monkeypatch.setattr(jit, "on_disk", lambda modules: True)  # filled before: each measurement loads them
    assert footprint.compile_ahead(plan, 2) == ()
    monkeypatch.setattr(footprint, "kernel_spec", lambda plan: "")
    assert footprint.compile_ahead(plan, 2) == ()


def _twice(x: float) -> float:
    return x * 2


def test_a_numba_cache_counts_as_filled_once_a_kernel_of_the_modules_is_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a run compiles its kernels ahead (compile_ahead) is read from numba's disk cache: a fresh one (a new
    runtime's) holds no index of the modules' kernels, and one a process compiled them into does."""
    pytest.importorskip("numba")
    from numba.core import config

    from resumerge.outputs.gguf import jit

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    kernels = jit.lazy_kernels(lambda twice: twice, _twice)
    monkeypatch.setattr(sys.modules[__name__], "kernels", kernels, raising=False)  # a module's, as the encoders' are
    assert not jit.on_disk([__name__])
    compiled = kernels()
    assert compiled is not None and compiled(2.0) == 4.0  # compiled, and kept in the cache
    assert jit.on_disk([__name__])
