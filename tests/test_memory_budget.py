"""A real merge of inputs several times larger than its memory budget stays under that budget.

The child's memory is watched through a small launcher (see ``support.peak_rss_and_held_run``): its peak RSS from
``wait4``, what the budget counts (the whole process, the file pages of its shared libraries included: importing
torch alone takes about 225 MB here, 507 MB with CUDA-enabled torch).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ModelFactory
from safetensors import safe_open
from safetensors.torch import load_file
from support import linear_config, peak_rss_and_held_run, write_config

from resumerge.cli.commands import main
from resumerge.machine.memory import parse_size

BUDGET = 600_000_000


def _negated(model: Path, to: Path) -> Path:
    """A copy of float32 ``model`` at ``to`` with every value negated (the top bit of each element flipped in place
    in the copy's mapped bytes): a second model of other values for the cost of a copy, where drawing a second
    gigabyte of random numbers cost 2.3 more CPU seconds."""
    shutil.copytree(model, to)
    for shard in to.glob("*.safetensors"):
        data = np.memmap(shard, dtype=np.uint8, mode="r+")
        start = 8 + int(data[:8].view("<u8")[0])
        assert {v["dtype"] for k, v in json.loads(data[8:start].tobytes()).items() if k != "__metadata__"} == {"F32"}
        body = data[start:].view("<u4")
        body ^= np.uint32(1 << 31)
        data.flush()
        del body, data
    return to


@pytest.mark.slow
def test_two_gb_of_inputs_under_a_600_mb_budget(tmp_path: Path, make: ModelFactory) -> None:
    spec = {"layers": 8, "hidden": 2048, "intermediate": 1536, "vocab": 16000, "heads": 16, "kv_heads": 16,
            "shard_bytes": 400_000_000, "tokenizer": False}
    a = make("a", seed=1, **spec)
    b = _negated(a, a.parent / "b")
    inputs = sum(p.stat().st_size for d in (a, b) for p in d.glob("*.safetensors"))
    assert inputs > 1_900_000_000
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    code, peak, held, err = peak_rss_and_held_run([sys.executable, "-m", "resumerge", "run", str(cfg), str(out),
                                                   "--quiet", "--max-memory", "600MB", "--out-shard-size", "300M"])
    assert code == 0, err
    # The budget counts the process's whole resident set (SystemProbe.rss, issue 71): the OS's peak stays within it.
    # It counted anonymous memory alone before, and a CUDA-enabled torch's 224 MB of mapped libraries put the peak
    # at 647 MB, over the budget by file pages alone.
    assert peak <= BUDGET, f"peak RSS {peak / 1e6:.0f} MB (anonymous {held / 1e6:.0f} MB) over {BUDGET / 1e6:.0f} MB"
    with safe_open(str(sorted(out.glob("model-*.safetensors"))[0]), "pt") as shard:
        name = next(iter(shard.keys()))
        got = shard.get_tensor(name)
    ta, tb = (_tensor(d, name) for d in (a, b))
    torch.testing.assert_close(got, (0.3 * ta + 0.7 * tb), rtol=1e-5, atol=1e-6)


def test_the_launcher_counts_an_anonymous_peak_that_file_pages_followed(tmp_path: Path) -> None:
    # 64 MB anonymous, freed, then 64 MB of file pages: the peak RSS less the most file pages seen (the old
    # figure) is the interpreter's few MB; the sampled anonymous peak is the 64 MB.
    (tmp_path / "f").write_bytes(b"\1" * 64_000_000)
    child = ("import mmap, time\nheld = b'\\1' * 64_000_000\ntime.sleep(0.1)\ndel held\n"
             f"with open({str(tmp_path / 'f')!r}, 'rb') as f:\n"
             "    pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
             "    assert sum(pages[i] for i in range(0, len(pages), 4096)) > 0\n"
             "    time.sleep(0.1)\n")
    code, peak, held, err = peak_rss_and_held_run([sys.executable, "-c", child])
    assert code == 0, err
    assert 64_000_000 <= held < peak, (held, peak)


def _tensor(model: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``model``, read alone (its shards are 400 MB)."""
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), "pt") as shard:
            if name in shard.keys():  # noqa: SIM118 (safe_open is no mapping)
                found: torch.Tensor = shard.get_tensor(name)
                return found
    raise AssertionError(f"{name} is in no shard of {model}")


def test_whole_tensor_unit_over_budget_is_refused_before_work(tmp_path: Path, make: ModelFactory,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1, hidden=256, vocab=4000), make("b", seed=2, hidden=256, vocab=4000)
    from resumerge.merge.methods import get_method

    whole = next(m for m in ("ties", "slerp", "model_stock") if (spec := get_method(m)) and not spec.elementwise)
    doc = {"merge_method": whole, "base_model": str(a), "parameters": {"t": 0.5, "weight": 1.0, "density": 0.5},
           "models": [{"model": str(a)}, {"model": str(b)}]}
    if whole == "model_stock":
        pytest.skip("needs three models")
    cfg = write_config(tmp_path / "c.yml", doc)
    code = main(["run", str(cfg), str(tmp_path / "out"), "--quiet", "--max-memory", "1MB"])
    err = capsys.readouterr().err
    assert code == 2, err
    # one line naming the tensor, the budget and the smallest budget that works, in a form --max-memory takes
    found = re.fullmatch(r"error: tensor (\S+) \(ties\) needs more memory than the budget of 1\.00 MB — the smallest "
                         r"budget that works is (\S+ \S+); rerun with --max-memory (\S+) or more\n", err)
    assert found is not None, err
    assert any(found[1] in load_file(str(f)) for f in a.glob("*.safetensors"))
    assert parse_size(found[2]) == parse_size(found[3]) > 1_000_000
    assert not (tmp_path / "out").exists()
