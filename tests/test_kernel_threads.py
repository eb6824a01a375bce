"""Where a whole tensor's kernels run: on its worker's thread alone when the engine's workers fill torch's threads,
spread over torch's threads otherwise, decided by the run's settings alone; and the CLI's huge-page setting."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import torch
from support import write_config
from toycodec import RowScaledInt8

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.inputs import kernels
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.compute import TensorCompute
from resumerge.merge.engine.workspace import Workspace
from resumerge.merge.plan.inputrefs import read_value
from resumerge.merge.plan.merge_plan import InputRef

SPEC = ModelSpec(layers=1, hidden=64, intermediate=128, vocab=256, heads=4, kv_heads=4, shard_bytes=10_000_000,
                 tokenizer=False, dtype=torch.float32)


@pytest.fixture
def threads_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch's thread count as each whole-tensor computation saw it; torch's own setting is restored after."""
    seen: list[int] = []
    real = TensorCompute.whole

    def recording(self: TensorCompute, workspace: Workspace | None = None) -> dict[str, torch.Tensor]:
        seen.append(torch.get_num_threads())
        return real(self, workspace)

    monkeypatch.setattr(TensorCompute, "whole", recording)
    before = torch.get_num_threads()
    try:
        yield seen
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def della_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("threads")
    a, b, c = (make_model(root / name, SPEC, seed=seed) for seed, name in enumerate("abc"))
    return write_config(root / "della.yml", {
        "merge_method": "della", "base_model": str(a),
        "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5, "epsilon": 0.1}} for m in (b, c)],
    })


@pytest.mark.skipif(kernels._openmp() is None, reason="torch's OpenMP runtime is not reachable here")
@pytest.mark.parametrize(("threads", "expected"), [(2, 1), (4, 4)])
def test_whole_tensors_run_serially_when_the_workers_fill_torchs_threads(
    della_config: Path, tmp_path: Path, threads_seen: list[int], threads: int, expected: int
) -> None:
    # Two workers (the default): with -j 2 they are torch's threads, so each computes on its own thread; with -j 4
    # torch has threads to spare and each tensor's kernels use them.
    code = main(["run", str(della_config), str(tmp_path / "out"), "--state-dir", str(tmp_path / "state"),
                 "--quiet", "-j", str(threads)])
    assert code == 0
    assert threads_seen and set(threads_seen) == {expected}


def test_a_run_recorded_before_mkl_was_pinned_with_its_j_is_not_resumed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 87: a plan whose bytes follow -j (slerp here) computed its MKL kernels on -j's threads in a serial block
    before they were pinned; such a run, stopped and resumed by today's resumerge with the same -j, is refused with
    a sentence saying why, never finished into a mix of both kernels' bytes."""
    from resumerge import api
    from resumerge.errors import InterruptedMerge, PlanChangedError
    from resumerge.merge.engine import frozenplan
    from resumerge.merge.plan import merge_plan

    a, b = (make_model(tmp_path / name, SPEC, seed=seed) for seed, name in enumerate("ab"))
    config = write_config(tmp_path / "slerp.yml", {
        "merge_method": "slerp", "base_model": str(a), "parameters": {"t": 0.3},
        "models": [{"model": str(a)}, {"model": str(b)}]})
    out, state = tmp_path / "out", tmp_path / "state"
    pinned = merge_plan._output_options

    def before_pinning(options: merge_plan.PlanOptions) -> dict[str, object]:
        return {k: v for k, v in pinned(options).items() if k != "kernels"}

    before = torch.get_num_threads()
    try:
        # as that resumerge planned it, and stored its plan (whose key held no kernels' rule)
        monkeypatch.setattr(merge_plan, "_output_options", before_pinning)
        monkeypatch.setattr(frozenplan, "PINNED_KERNELS", None)
        with pytest.raises(InterruptedMerge):
            api.run(config, out, settings=api.Settings(state_dir=state, resources=api.Resources(num_threads=2)),
                    should_stop=lambda: True)
        monkeypatch.undo()
        with pytest.raises(PlanChangedError, match="-j 2's kernels changed"):
            api.resume(out, settings=api.Settings(state_dir=state))
    finally:
        torch.set_num_threads(before)


def test_the_cli_asks_torch_for_huge_pages_unless_told_otherwise(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's main sets THP_MEM_ALLOC_ENABLE before torch's first import (torch reads it at its first
    allocation), a user's own value stands, and a process that imported torch first (a notebook's, this worker's)
    keeps its own setting. One fresh interpreter for both settings, which never imports torch (``status`` does
    not): what main sets is read from the environment torch would read, not from torch (two interpreters that
    imported torch only to print the variable cost ~6 CPU s)."""
    probe = ("import os, sys\nfrom resumerge.cli.commands import main\n"
             "for value in (None, '0'):  # unset, then a user's own choice\n"
             "    os.environ.pop('THP_MEM_ALLOC_ENABLE', None)\n"
             "    if value is not None:\n"
             "        os.environ['THP_MEM_ALLOC_ENABLE'] = value\n"
             "    main(['status', sys.argv[1]])\n"
             "    print(os.environ.get('THP_MEM_ALLOC_ENABLE'), 'torch' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    ran = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert ran.stdout.strip().splitlines()[-2:] == ["1 False", "0 False"], ran.stdout + ran.stderr
    # torch imported before main (this process): its allocator has read the variable already, left as it was
    assert "torch" in sys.modules
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    main(["status", str(tmp_path)])
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ


def test_serial_kernels_set_torchs_own_openmp_runtime_when_another_is_loaded_later() -> None:
    """sentencepiece (which transformers loads) maps its own libgomp copy; loaded after torch it sits at a lower
    address, first in /proc/self/maps. Taking the first runtime found set that copy's threads, torch kept splitting
    whole-tensor sums over its threads, and a notebook that imported transformers computed other bits than a fresh
    process (seen as an extraction whose adapter differed inside a test worker)."""
    pytest.importorskip("sentencepiece")
    # sentencepiece after torch, as a notebook or a test worker loads it
    name, took, inside, after = _serial_in_fresh_process("import torch\nimport sentencepiece\n", "runtime._name")
    assert "sentencepiece" not in name and took == "True" and int(inside) == 1 and int(after) == 2


def _serial_in_fresh_process(before: str, shown: str) -> list[str]:
    """In a fresh Python that ran ``before``: ``shown`` (an expression of ``runtime``, the OpenMP runtime found
    then, and ``loaded``, whether torch was loaded as it was looked for), whether ``serial_kernels`` said it took
    effect, torch's threads inside it with two set, and after it."""
    code = (
        f"{before}"
        "from resumerge.inputs import kernels\n"
        "import sys\n"
        "loaded = 'torch' in sys.modules\n"  # whether torch was loaded when the runtime was looked for
        "runtime = kernels._openmp()\n"
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "with kernels.serial_kernels() as took:\n"
        "    inside = torch.get_num_threads()\n"
        f"print({shown}, took, inside, torch.get_num_threads())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(kernels._openmp() is None, reason="torch's OpenMP runtime is not reachable here")
def test_serial_kernels_find_the_runtime_when_first_used_before_torch_is_imported() -> None:
    """resumerge imports torch lazily (planning never needs it), so the first ``serial_kernels`` can come before
    torch is loaded. The runtime was looked up in /proc/self/maps before touching torch, found nothing and cached
    that: every later "serial" block ran split over torch's threads (a 128 Ki-entry chunk's kernels 30x slower)."""
    shown = _serial_in_fresh_process("", "loaded, runtime is not None")
    assert shown == ["False", "True", "True", "1", "2"]  # torch not loaded when the runtime was looked for


def test_serial_kernels_say_so_where_no_openmp_runtime_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the runtime the kernels stay on torch's threads, and the block says so: timed by the calling
    thread's CPU they would count only its share of the work (the speed sample then takes the wall clock)."""
    monkeypatch.setattr(kernels, "_openmp", lambda: None)
    with kernels.serial_kernels() as took:
        assert took is False


@pytest.mark.skipif(kernels._openmp() is None, reason="torch's OpenMP runtime is not reachable here")
def test_serial_kernels_pin_mkls_threads_once_torchs_count_was_set() -> None:
    """Issue 87: MKL follows a thread's OpenMP count only until the process's first ``torch.set_num_threads`` (a
    ``-j``, a notebook's or another library's call) turns its dynamic mode off; from then on a serial block's
    products and QRs were split over torch's threads again: a ``-j 2`` run, or one in a process that had set the
    count once, computed other bits than a fresh process. A QR-based probe of real size computed in a serial block
    with two threads set gives the one-thread bytes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 2816, generator=g)
    omega = torch.randn(2816, 16, generator=g)

    def probe() -> bytes:
        q, _ = torch.linalg.qr(x @ omega)
        for _ in range(3):
            z, _ = torch.linalg.qr(x.T @ q)
            q, _ = torch.linalg.qr(x @ z)
        return (q.T @ x).numpy().tobytes()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = probe()
        torch.set_num_threads(2)
        if probe() == alone:
            pytest.skip("this BLAS gives the probe the same bits on one thread and two: nothing to tell apart")
        with kernels.serial_kernels() as took:
            assert took and probe() == alone
        assert probe() != alone  # two threads again after the block
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(kernels._openmp() is None, reason="torch's OpenMP runtime is not reachable here")
def test_a_quantized_decode_runs_on_the_reading_thread_alone_whoever_reads_it() -> None:
    # read_value is the one reader of the engine, the MoE pass and LoRA extraction's ranks (which read outside the
    # engine's workers): each quantized decode in it runs serially, a plain read is left alone.
    seen: list[int] = []

    @dataclass(frozen=True)
    class Recording(RowScaledInt8):
        def decode(self, parts: Mapping[str, torch.Tensor], first_row: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return super().decode(parts, first_row, out)

    class Source:
        def read(self, model: str, file: str, start: int, end: int, dtype: str,
                 shape: tuple[int, ...]) -> torch.Tensor:
            return torch.ones(shape, dtype=torch.int8 if dtype == "I8" else torch.float32)

    scale = InputRef("m", "f", "w_scale", "F32", (4,), 0, 16)
    ref = InputRef("m", "f", "w", "I8", (4, 3), 0, 12, codec=Recording(), companions=(("scale", scale),))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        value = read_value(ref, cast(InputSources, Source()))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert torch.equal(value, torch.ones(4, 3))


@pytest.fixture(scope="module")
def gguf_merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A linear merge of two tiny llama GGUFs (its config) and texts their vocabulary spells."""
    from ggufmodels import linear_llama_pair

    return linear_llama_pair(tmp_path_factory.mktemp("gguf-threads"),
                             "the cat sat on the mat.\nthree plus four is seven.\n")


@pytest.mark.skipif(kernels._openmp() is None, reason="torch's OpenMP runtime is not reachable here")
def test_the_importance_pass_runs_each_layer_on_one_thread_whatever_j_says(
        gguf_merge: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A text's products are a few dozen rows: split over torch's threads, each kernel spun at the barrier for a core
    # the run's other work held (a third of bench_kquant_route.py's CPU). Its bits are then -j's no longer.
    from resumerge.forward.engine.stream import ModelStream

    seen: list[int] = []
    real = ModelStream.run

    def recording(self: ModelStream, layer: torch.nn.Module, hidden: torch.Tensor, call: object,
                  **kwargs: bool) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real(self, layer, hidden, call, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelStream, "run", recording)
    config, texts = gguf_merge
    before = torch.get_num_threads()
    try:
        code = main(["run", str(config), str(tmp_path / "out"), "--state-dir", str(tmp_path / "state"), "--quiet",
                     "-j", "2", "--out-type", "gguf", "--gguf-type", "q4_k_m", "--imatrix-texts", str(texts)])
        assert code == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


def test_a_streamed_tensors_chunks_are_encoded_on_the_workers_to_the_same_bytes(
        gguf_merge: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A tensor streamed in row chunks (a quantized GGUF's embeddings and head, past a quarter of the budget) was
    # encoded on the calling thread while the pool sat idle: one core of two for the largest tensors.
    from resumerge.merge.engine import executor
    from resumerge.merge.plan import workunits
    from resumerge.outputs.gguf import encoders

    config, _ = gguf_merge
    args = ["--quiet", "--out-type", "gguf", "--gguf-type", "q8_0", "--max-memory", "4GB"]
    assert main(["run", str(config), str(tmp_path / "whole"), "--state-dir", str(tmp_path / "s1"), *args]) == 0
    threads: list[str] = []
    real_encode, real_mode = encoders.encode, executor.unit_mode

    def encode(values: torch.Tensor, ggml_type: int, *rest: object, **kwargs: object) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return real_encode(values, ggml_type, *rest, **kwargs)  # type: ignore[arg-type]

    def streamed(tp: object, *rest: object, **kwargs: object) -> str:  # every tensor of two rows or more
        shape = getattr(tp, "shape", ())
        # type: ignore[arg-type]
        return workunits.ROWS if len(shape) == 2 and shape[0] > 1 else real_mode(tp, *rest, **kwargs)

    monkeypatch.setattr(encoders, "encode", encode)
    monkeypatch.setattr(executor, "unit_mode", streamed)
    assert main(["run", str(config), str(tmp_path / "rows"), "--state-dir", str(tmp_path / "s2"), *args]) == 0
    assert threads and all(name.startswith("resumerge-merge") for name in threads)
    whole, rows = ((tmp_path / out / "model.gguf").read_bytes() for out in ("whole", "rows"))
    assert rows == whole
