"""``--device``: GPU compute with its own memory budget, and the refusals around it.

This machine has no GPU, so the GPU governor's admission is exercised with a scripted probe on CPU arithmetic
(the engine's GPU path differs only in where tensors live), and a real CUDA run is checked when torch sees one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.locations import StateDir
from resumerge.config.merge_config import load_config_text
from resumerge.errors import UsageError
from resumerge.machine.memory import FakeProbe, MemoryGovernor, Reservation, parse_size
from resumerge.machine.memory.budget import smallest_budget_for
from resumerge.merge.engine.devices import gpu_governor, normalise_device
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.store.statusview import read_status
from tests.conftest import ModelFactory
from tests.support import cli, digests, linear_config, write_config


@pytest.mark.parametrize(("text", "want"), [("cpu", "cpu"), ("CUDA", "cuda:0"), ("cuda:1", "cuda:1")])
def test_device_names_are_normalised(text: str, want: str) -> None:
    assert normalise_device(text) == want


@pytest.mark.parametrize("text", ["mps", "cuda:x", "gpu", ""])
def test_unknown_devices_are_refused(text: str) -> None:
    with pytest.raises(UsageError, match="unknown device"):
        normalise_device(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_before_out_is_touched(tmp_path: Path, make: ModelFactory,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    done = cli("run", config, out, "--cuda")
    assert done.returncode == 2, done.stderr
    assert "torch sees no CUDA GPU" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
    capsys.readouterr()
    assert main(["run", str(config), str(out), "--device", "tpu"]) == 2  # the same entry point, in this process
    assert "unknown device 'tpu'" in capsys.readouterr().err


class _CountingGovernor(MemoryGovernor):
    """Records every reservation and the most bytes reserved at once."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.grants: list[int] = []
        self.outstanding = 0
        self.most = 0
        self._count_lock = threading.Lock()

    def acquire(self, estimate_bytes: int, *, timeout: float | None = None, what: str | None = None,
                make_room: Callable[[], object] | None = None, held: bool = False) -> Reservation:
        reservation = super().acquire(estimate_bytes, timeout=timeout, what=what, make_room=make_room, held=held)
        with self._count_lock:
            self.grants.append(estimate_bytes)
            self.outstanding += estimate_bytes
            self.most = max(self.most, self.outstanding)
        return reservation

    def _release(self, reservation: Reservation) -> None:
        with self._count_lock:
            self.outstanding -= reservation.nbytes
        super()._release(reservation)


def test_gpu_budget_governs_units_and_streams_rows(tmp_path: Path, make: ModelFactory,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A small GPU budget under a roomy host budget: every unit holds a GPU reservation while it computes, large
    tensors are cut into row chunks to fit it, nothing is left reserved, and the bytes equal a plain CPU run."""
    a = make("a", seed=1, hidden=64, intermediate=256, vocab=512, layers=2)
    b = make("b", seed=2, hidden=64, intermediate=256, vocab=512, layers=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    api.run(config, tmp_path / "plain", settings=api.Settings(state_dir=tmp_path / "s1"))

    budget = 600_000  # the embedding (512 x 64 fp32 inputs + working set) needs ~1 MB whole
    made: list[_CountingGovernor] = []

    def fake_gpu(plan: object, device: str, max_gpu_memory: int | None) -> MemoryGovernor | None:
        gov = _CountingGovernor(budget, FakeProbe(), pool="cuda:0",
                                budget_option="--max-gpu-memory")
        made.append(gov)
        return gov

    monkeypatch.setattr("resumerge.merge.engine.drive.gpu_governor", fake_gpu)
    api.run(config, tmp_path / "gpu", settings=api.Settings(state_dir=tmp_path / "s2",
                                                            resources=api.Resources(max_memory="4GB")))
    gov = made[0]
    plan = plan_from_config(load_config_text(config.read_text()), PlanOptions())
    assert len(gov.grants) > len(plan.tensors)  # the two vocab tensors were streamed in chunks
    assert max(gov.grants) <= budget and gov.most <= budget
    assert gov.outstanding == 0
    assert digests(tmp_path / "gpu") == digests(tmp_path / "plain")
    # status tells the host's budget and admissions, not the GPU's events recorded after them
    report = read_status(tmp_path / "gpu", StateDir.resolve(tmp_path / "s2"))
    assert report.budget == parse_size("4GB") and report.admissions is not None and report.admissions > 0


def test_a_whole_tensor_over_the_gpu_budget_names_the_smallest_that_works(tmp_path: Path,
                                                                         make: ModelFactory) -> None:
    a = make("a", seed=1, hidden=64, intermediate=256, vocab=512, layers=2)
    b = make("b", seed=2, hidden=64, intermediate=256, vocab=512, layers=2)
    c = make("c", seed=3, hidden=64, intermediate=256, vocab=512, layers=2)
    doc: dict[str, object] = {"merge_method": "ties", "base_model": str(a),
           "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in (b, c)]}
    plan = plan_from_config(load_config_text(write_config(tmp_path / "t.yml", doc).read_text()), PlanOptions())
    with pytest.raises(UsageError, match="needs more GPU memory") as caught:
        gpu_governor(plan, "cuda:0", 100_000, probe=FakeProbe())
    assert "--max-gpu-memory" in caught.value.one_line()
    needed = caught.value.one_line().split("smallest GPU budget that works is ")[1].split(";")[0]
    assert gpu_governor(plan, "cuda:0", parse_size(needed), probe=FakeProbe()) is not None
    assert gpu_governor(plan, "cpu", 1, probe=FakeProbe()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_merge_matches_cpu_and_resume_keeps_the_device(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    api.run(config, tmp_path / "cpu", settings=api.Settings(state_dir=tmp_path / "s1"))
    done = cli("run", config, tmp_path / "gpu", "--device", "cuda", "--state-dir", tmp_path / "s2",
               env={"RESUMERGE_KILL_AT": "after_ledger_commit:2"})
    assert done.returncode != 0
    done = cli("resume", tmp_path / "gpu", "--state-dir", tmp_path / "s2")
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    for name in sorted(p.name for p in (tmp_path / "cpu").glob("*.safetensors")):
        want, got = load_file(tmp_path / "cpu" / name), load_file(tmp_path / "gpu" / name)
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_codec_encodes_and_decodes_on_the_gpu_to_the_cpus_bytes() -> None:
    # The codecs' contract: the same float32 values give the same stored bytes wherever they are encoded. Columns
    # from 1e-30 to 1e3 (normal scales only: a block's amax is its largest column's), an all-zero block, and whole
    # blocks of ~1e-44, ~1e-40 and ~1e-37 (rows 16:32 and 32:, where every codec's blocks and groups start; in
    # MXFP4's groups of 32 along that dimension rows 0:32 are zeros and ~1e-44): scales below float32's smallest
    # normal, so the clamp of scales_for (amax / 448 rounds to 0 below ~3e-43), frexp/ldexp on subnormals (ue8m0,
    # MXFP4) and compressed-tensors' eps fill for a zero scale are compared as well.
    from tests.quant.test_codec_devices import CODECS

    cuda = torch.device("cuda")
    for codec, shape in CODECS:
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        value = noise * torch.logspace(-30, 3, shape[-1])
        value[..., :16, :16] = 0.0
        value[..., 16:32, :16] = noise[..., 16:32, :16] * 1e-44
        value[..., 16:32, 16:] = noise[..., 16:32, 16:] * 1e-40
        value[..., 32:, :] = noise[..., 32:, :] * 1e-37
        want = codec.encode(value, "F32")
        got = codec.encode(value.to(cuda), "F32")
        assert got.keys() == want.keys()
        for part, t in got.items():
            assert t.device.type == "cuda", (codec, part)
            assert torch.equal(t.cpu().view(torch.uint8), want[part].view(torch.uint8)), (codec, part)
        decoded = codec.decode({part: t.to(cuda) for part, t in want.items()}, 0)
        assert decoded.device.type == "cuda"
        assert torch.equal(decoded.cpu().view(torch.int32), codec.decode(want, 0).view(torch.int32)), codec


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dequantize", [False, True])
def test_a_block_fp8_merge_runs_on_the_gpu(tmp_path: Path, make: ModelFactory, dequantize: bool) -> None:
    # Kept FP8 crashed here once (the encode's scratch on the CPU, the merged values on the GPU). The GPU's sums may
    # round differently in the last bit (fused multiply-adds), so a code may land one FP8 step away: values compare
    # within that step, layouts exactly.
    from safetensors.torch import load_file

    from tests.quantmodels import fp8, fp8_config
    from tests.test_quant_codecs import pair

    a, b = pair(tmp_path, make, fp8((16, 16)), fp8_config((16, 16)))
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    flag = ["--dequantize"] if dequantize else []
    done = cli("run", config, tmp_path / "cpu", "--state-dir", tmp_path / "s1", *flag)
    assert done.returncode == 0, done.stderr
    done = cli("run", config, tmp_path / "gpu", "--device", "cuda", "--state-dir", tmp_path / "s2", *flag)
    assert done.returncode == 0, done.stderr
    for name in sorted(p.name for p in (tmp_path / "cpu").glob("*.safetensors")):
        want, got = load_file(tmp_path / "cpu" / name), load_file(tmp_path / "gpu" / name)
        assert want.keys() == got.keys()
        assert any(t.dtype == torch.float8_e4m3fn for t in want.values()) != dequantize
        for key in want:
            assert (got[key].dtype, got[key].shape) == (want[key].dtype, want[key].shape), key
            if want[key].dtype == torch.float8_e4m3fn:  # one E4M3 step: 2^-3 of a value, 2^-9 near zero
                torch.testing.assert_close(got[key].float(), want[key].float(), rtol=2**-3, atol=2**-9)
            else:
                torch.testing.assert_close(got[key], want[key])


# -- the forward pass's device (--device cuda in check, measure, eval, evolve: resumerge.forward.engine.device)
# -------------

PASS_SPEC_LAYERS = 3
PASS_TOKENS = [[1, 5, 9, 13, 2], [3, 4, 5], [7, 8, 9, 10, 11, 12, 2]]


def _pass_models(tmp_path: Path, layers: int = PASS_SPEC_LAYERS, hidden: int = 32, intermediate: int = 48
                 ) -> list[object]:
    from dataclasses import replace

    from resumerge.cli.modelgen import ModelSpec, make_model
    from resumerge.forward.opening.opened import open_for_pass

    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=intermediate, vocab=64)
    state = StateDir.resolve(tmp_path / "state")
    return [replace(open_for_pass(str(make_model(tmp_path / role, spec, seed=seed)), role, state), role=role)
            for role, seed in (("merge", 3), ("base", 4), ("parent", 5))]


def _check_pass(models: list[object], workdir: Path, device: str | None) -> object:
    from resumerge.forward.compared.passes import forward_pass, streams_of

    streams = streams_of(models) if device is None else streams_of(models, device)  # type: ignore[arg-type]
    try:
        return forward_pass(models, streams, PASS_TOKENS, workdir)  # type: ignore[arg-type]
    finally:
        for stream in streams:
            stream.close()


def test_a_pass_device_reads_device_as_run_does_and_refuses_a_gpu_budget_on_the_cpu() -> None:
    from resumerge.forward.engine.device import HOST, PassDevice

    assert PassDevice.of("CPU") == HOST and not HOST.on_gpu
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        PassDevice.of("tpu")
    with pytest.raises(UsageError, match="is the GPU's budget, and this pass runs on the CPU") as caught:
        PassDevice.of("cpu", "1GB")
    assert "--device cuda" in caught.value.one_line()
    if not torch.cuda.is_available():  # run's own words, from the one owner (memory.cuda.CudaProbe)
        with pytest.raises(UsageError, match="torch sees no CUDA GPU"):
            PassDevice.of("cuda:1", "2GB")


def test_a_pass_on_a_gpu_is_refused_a_step_its_budget_cannot_hold_naming_the_smallest() -> None:
    from resumerge.forward.engine.device import HOST, GpuBudget, PassDevice
    from resumerge.forward.job.admission import Admission
    from resumerge.machine.memory import default_budget
    from resumerge.machine.memory.cuda import GPU_FRACTION

    probe = FakeProbe(rss=50_000, available=10**9)
    steps = {"layer": 2_000_000, "heads": 700_000}
    assert HOST.budget("the check", steps, 10**12, probe=probe) is None  # the host: no GPU budget at all
    with pytest.raises(UsageError, match=r"needs 2\.30 MB of GPU memory on cuda:0") as caught:
        PassDevice("cuda:0", 1_000_000).budget("the check", steps, 300_000, probe=probe)
    line = caught.value.one_line()
    assert "largest step 2.00 MB beside the hidden states' 300 kB" in line and "or use --device cpu" in line
    named = parse_size(line.split("rerun with --max-gpu-memory ")[1].split(" ")[0])
    fits = PassDevice("cuda:0", named).budget("the check", steps, 300_000, probe=probe)
    assert fits is not None and fits.budget == named and dict(fits.steps) == steps
    with pytest.raises(UsageError):  # a byte less than named does not fit
        PassDevice("cuda:0", named - 10_000).budget("the check", steps, 300_000, probe=probe)
    default = PassDevice("cuda:0").budget("the check", steps, 300_000, probe=probe)
    assert default is not None and default.budget == default_budget(probe, GPU_FRACTION)

    # Each step is then held from the GPU's governor as well as the RAM's: one beyond the GPU budget is refused there
    held = GpuBudget("cuda:0", named, {"layer": 1_000, "heads": named * 2}, probe)
    with Admission(10**12, {"layer": 1_000, "heads": 1_000}, gpu=held) as reserve:
        with reserve("layer 0 of model 1", "layer"):
            assert reserve.on_gpu is not None and reserve.on_gpu.largest_admitted == 1_000
            assert reserve.governor.largest_admitted == 1_000
        with pytest.raises(UsageError, match=r"of cuda:0 memory.*max_gpu_memory"), reserve("the heads", "heads"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_check_measure_and_eval_refuse_cuda_without_a_gpu_before_reading_a_weight(tmp_path: Path,
                                                                                  make: ModelFactory) -> None:
    from tests.support import cli_here

    a, b = make("a", seed=1), make("b", seed=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    state = tmp_path / "state"
    for args in (("check", a, "--base", b, "--device", "cuda"), ("measure", config, tmp_path / "g", "--device", "cuda"),
                 ("eval", a, "--tasks", "anything", "--device", "cuda:0"), ("check", a, "--max-gpu-memory", "1GB"),
                 ("evolve", config, tmp_path / "store", "--device", "cuda")):
        done = cli_here(*args, *(("--state-dir", state) if args[0] != "evolve" else ()))
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) <= 2 and "Traceback" not in done.stderr, done.stderr
        assert ("torch sees no CUDA GPU" if "--device" in args else "--max-gpu-memory") in done.stderr
    assert not (tmp_path / "g").exists() and not (tmp_path / "store").exists()  # nothing written
    assert not list(state.rglob("*.safetensors"))  # nothing read


def test_check_and_measure_take_the_device_in_run_s_resources_and_measure_s_plan_refuses_it(
        tmp_path: Path, make: ModelFactory) -> None:
    # One settings object: a check's and a measurement's device and GPU budget are Resources' fields, read by the
    # pass (PassDevice.of's own refusal, not "does not apply"); measure --plan reads headers on the host: refused.
    a, b = make("a", seed=1), make("b", seed=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    state = tmp_path / "state"
    gpu_budget = api.Settings(state_dir=state, resources=api.Resources(max_gpu_memory="1GB"))
    for call in (lambda: api.check(a, base=b, settings=gpu_budget),
                 lambda: api.measure(config, tmp_path / "g", settings=gpu_budget)):
        with pytest.raises(UsageError, match="is the GPU's budget, and this pass runs on the CPU"):
            call()
    for resources, field in ((api.Resources(device="cuda"), "device"),
                             (api.Resources(max_gpu_memory="1GB"), "max_gpu_memory")):
        with pytest.raises(UsageError, match=f"^{field} does not apply to estimate_measure"):
            api.estimate_measure(config, settings=api.Settings(resources=resources, state_dir=state))
    assert not (tmp_path / "g").exists() and not list(state.rglob("*.safetensors"))


def test_a_pass_on_this_machine_s_gpu_and_on_ray_is_refused_in_one_line_before_anything_is_read(
        tmp_path: Path) -> None:
    # A GPU here and Ray's executor name two places for the same layers: check, measure and eval each refuse the
    # pair, naming both, before the models are opened (the paths below do not exist).
    from resumerge.analyses.check.job import CheckSettings
    from resumerge.analyses.check.run import CheckAsked, run_check
    from resumerge.analyses.evaluation.run import run_eval
    from resumerge.analyses.evaluation.settings import EvalSettings
    from resumerge.analyses.measure.run import MeasureSettings, measure_grams
    from resumerge.config.passplace import PassPlace
    from resumerge.forward.engine.device import PassDevice

    state = StateDir.resolve(tmp_path / "state")
    gpu = PassDevice("cuda:0")
    ray = PassPlace("ray")
    on_ray = CheckSettings(state=state, placement=ray, device=gpu)
    for call, what in ((lambda: run_check(CheckAsked(tmp_path / "m"), on_ray), "check"),
                       (lambda: measure_grams(tmp_path / "c.yml", tmp_path / "g",
                                              settings=MeasureSettings(None, state, ray, gpu)), "measurement"),
                       (lambda: run_eval(str(tmp_path / "m"), EvalSettings(("x",), device="cuda"), state=state,
                                         placement=ray), "evaluation")):
        with pytest.raises(UsageError, match=f"runs the {what}'s layers on this machine's GPU, and executor ray"
                           ) as caught:
            call()
        assert "leave out one of the two" in caught.value.one_line()
    assert not (tmp_path / "g").exists() and not (tmp_path / "state").exists()


def test_the_cli_refuses_a_gpu_pass_on_ray_in_one_line(tmp_path: Path, make: ModelFactory) -> None:
    # Whichever refusal comes first on this machine (no GPU, no Ray, or the pair), one line and exit 2.
    from tests.support import cli_here

    a, b = make("a", seed=1), make("b", seed=2)
    config = write_config(tmp_path / "c.yml", linear_config(a, b))
    for args in (("check", a, "--base", b), ("measure", config, tmp_path / "g"), ("eval", a, "--tasks", "x")):
        done = cli_here(*args, "--device", "cuda", "--executor", "ray", "--state-dir", tmp_path / "state")
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) <= 2 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "g").exists()


def test_a_pass_on_another_device_journals_the_hosts_bytes_and_resumes_on_the_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "cpu:0" is moved to as a GPU is (every weight, hidden state and call copied there, the journal written from
    # host copies), with the host's arithmetic: the device's paths, run without a GPU, give the host's bytes.
    pytest.importorskip("transformers")
    from resumerge.forward.job import layerpass

    models = _pass_models(tmp_path)
    default = _check_pass(models, tmp_path / "default", None)
    assert _check_pass(models, tmp_path / "cpu", "cpu") == default
    assert _check_pass(models, tmp_path / "moved", "cpu:0") == default
    last = f"layer-{PASS_SPEC_LAYERS - 1:05d}.safetensors"
    journal = (tmp_path / "default" / last).read_bytes()
    assert (tmp_path / "cpu" / last).read_bytes() == journal == (tmp_path / "moved" / last).read_bytes()

    class Stopped(Exception):
        pass

    def stop_after_layer_1(point: str, **_: object) -> None:
        if (tmp_path / "across" / "layer-00001.safetensors").is_file():
            raise Stopped

    with monkeypatch.context() as patched:
        patched.setattr(layerpass, "reach", stop_after_layer_1)
        with pytest.raises(Stopped):
            _check_pass(models, tmp_path / "across", "cpu:0")  # started on the "device"
    assert _check_pass(models, tmp_path / "across", None) == default  # resumed on the host


def test_measure_s_grams_on_another_device_are_the_hosts_bytes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from resumerge.analyses.measure.grams import GramWatch, measure_model, tokens_of
    from resumerge.analyses.measure.passes import stream_of
    from resumerge.forward.job.placement import Streams
    from resumerge.forward.text.batches import one_by_one

    model = _pass_models(tmp_path)[0]
    batches = one_by_one(PASS_TOKENS)
    for device in ("cpu", "cpu:0"):
        with stream_of(model, "merge", device) as stream:  # type: ignore[arg-type]
            watch = GramWatch(tokens_of(batches))
            measure_model(Streams([stream], watch=watch, rows=False), watch, batches, tmp_path / device, 0,
                          tmp_path / f"{device}-journal")
    grams = sorted(p.relative_to(tmp_path / "cpu") for p in (tmp_path / "cpu").rglob("*.safetensors"))
    assert len(grams) == PASS_SPEC_LAYERS
    assert all((tmp_path / "cpu" / p).read_bytes() == (tmp_path / "cpu:0" / p).read_bytes() for p in grams)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_check_on_the_gpu_gives_the_cpus_figures_and_a_check_killed_there_resumes_on_the_cpu(tmp_path: Path) -> None:
    models = _pass_models(tmp_path)
    merge, base, parent = (str(m.path) for m in models)  # type: ignore[attr-defined]
    cpu = api.check(merge, base=base, parents=[parent], settings=api.Settings(state_dir=tmp_path / "s-cpu"))
    gpu = api.check(merge, base=base, parents=[parent],
                    settings=api.Settings(state_dir=tmp_path / "s-gpu", resources=api.Resources(device="cuda")))
    done = cli("check", merge, "--base", base, "--parent", parent, "--device", "cuda", "--state-dir",
               tmp_path / "s-across", env={"RESUMERGE_KILL_AT": "after_check_layer:2"})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    across = api.check(merge, base=base, parents=[parent],
                       settings=api.Settings(state_dir=tmp_path / "s-across"))  # resumed on the CPU
    for found in (gpu, across):
        assert found.verdict == cpu.verdict
        for want, got in zip(cpu.models, found.models):
            for name in ("nll", "kl", "kl_p95", "top1"):
                w, g = getattr(want, name), getattr(got, name)
                assert (w is None) == (g is None) and (w is None or abs(w - g) <= 1e-5 * max(1.0, abs(w))), name
            torch.testing.assert_close(torch.tensor(got.drift), torch.tensor(want.drift), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_larger_than_the_gpu_budget_runs_a_layer_at_a_time_and_a_layer_beyond_it_is_refused(
        tmp_path: Path) -> None:
    # 16 layers of 1 MB (float32): the hidden states and the heads' step (vocabulary 64) are small beside them
    models = _pass_models(tmp_path, layers=16, hidden=128, intermediate=512)
    merge, base = (str(m.path) for m in models[:2])  # type: ignore[attr-defined]
    state = tmp_path / "state"
    # What this process already holds on the GPU (tables an earlier test of this worker cached there) counts against
    # the budget too, so the named budget is compared with the model beside it.
    before = torch.cuda.memory_allocated()
    with pytest.raises(UsageError, match="of GPU memory on cuda:0") as caught:
        api.check(merge, base=base,
                  settings=api.Settings(state_dir=state, resources=api.Resources(device="cuda", max_gpu_memory=1000)))
    assert not list(state.rglob("layer-*.safetensors"))  # refused before its first layer
    named = parse_size(caught.value.one_line().split("rerun with --max-gpu-memory ")[1].split(" ")[0])
    whole = sum(f.stat().st_size for f in Path(merge).glob("*.safetensors"))
    # the model (beside what the process holds) does not fit the budget it runs under: one layer at a time does
    assert named < smallest_budget_for(whole, baseline_bytes=before)
    found = api.check(merge, base=base, settings=api.Settings(
        state_dir=state, resources=api.Resources(device="cuda", max_gpu_memory=named)))
    want = api.check(merge, base=base, settings=api.Settings(state_dir=tmp_path / "s-cpu"))
    # type: ignore[operator]
    assert abs(found.models[0].nll - want.models[0].nll) <= 1e-5 * max(1.0, want.models[0].nll)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_on_the_gpu_gives_the_cpus_grams(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    models = _pass_models(tmp_path)
    # type: ignore[attr-defined]
    config = write_config(tmp_path / "c.yml", linear_config(Path(models[0].path), Path(models[1].path)))
    api.measure(config, tmp_path / "cpu", settings=api.Settings(state_dir=tmp_path / "s1"))
    api.measure(config, tmp_path / "gpu",
                settings=api.Settings(state_dir=tmp_path / "s2", resources=api.Resources(device="cuda")))
    files = sorted(p.relative_to(tmp_path / "cpu") for p in (tmp_path / "cpu").rglob("*.safetensors"))
    assert files
    for name in files:
        want, got = load_file(tmp_path / "cpu" / name), load_file(tmp_path / "gpu" / name)
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_the_command_that_continues_a_check_on_a_gpu_names_its_device(tmp_path: Path) -> None:
    from resumerge.analyses.check.run import check_command
    from resumerge.forward.engine.device import PassDevice

    state = StateDir.resolve(tmp_path / "state")
    on_cpu = check_command("m", "b", (), None, state)
    assert "--device" not in on_cpu  # as before: a check on the host names no device
    on_gpu = check_command("m", "b", (), None, state, device=PassDevice("cuda:1", 2_000_000_000))
    assert on_gpu == on_cpu.replace(" --state-dir", " --device cuda:1 --max-gpu-memory 2000000000 --state-dir")
