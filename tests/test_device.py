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
from resumerge.engine.devices import gpu_governor, normalise_device
from resumerge.engine.session import plan_from_config
from resumerge.errors import UsageError
from resumerge.memory import FakeProbe, MemoryGovernor, Reservation, parse_size
from resumerge.plan.merge_plan import PlanOptions
from resumerge.store.statusview import read_status
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
    api.run(config, tmp_path / "plain", state_dir=tmp_path / "s1")

    budget = 600_000  # the embedding (512 x 64 fp32 inputs + working set) needs ~1 MB whole
    made: list[_CountingGovernor] = []

    def fake_gpu(plan: object, device: str, max_gpu_memory: int | None) -> MemoryGovernor | None:
        gov = _CountingGovernor(budget, FakeProbe(), pool="cuda:0",
                                budget_option="--max-gpu-memory")
        made.append(gov)
        return gov

    monkeypatch.setattr("resumerge.engine.drive.gpu_governor", fake_gpu)
    api.run(config, tmp_path / "gpu", state_dir=tmp_path / "s2", resources=api.Resources(max_memory="4GB"))
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
    api.run(config, tmp_path / "cpu", state_dir=tmp_path / "s1")
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
