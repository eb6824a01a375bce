"""The hidden-state gates' prompt forward pass is a client of the one journaled layer pass like check and measure:
its embeddings and each decoder layer it runs are admitted by a RAM governor under the share of the budget its
process is given, and a pass run under the smallest share its refusal names stays inside it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.machine.memory import parse_size

pytest.importorskip("transformers")

from support import peak_rss_and_held_run

PROMPTS = [(["ab cd ef"], ["xy"]), (["Zq rs tu vw"], None)]

# The pass in a process of its own, as the run starts it (resumerge.runs.moe.passmain): the checks, then the routers
# under the share given (a refusal printed, exit 2).
_CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from resumerge.config.locations import StateDir
    from resumerge.errors import UsageError
    from resumerge.forward.opening.opened import open_for_pass
    from resumerge.runs.moe import forward

    model, work, share = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    ready = forward.pass_checks(model, model, "hidden", json.loads(sys.argv[4]))
    opened = open_for_pass(str(model), "base", StateDir.resolve(work / "state")).opened
    try:
        site = forward.InThisProcess(forward.Weights.of(opened.directory, opened.tensors), "hidden", share=share,
                                     ready=ready)
        forward.hidden_routers(site, ready.sets, work / "pass")
    except UsageError as exc:
        print(exc.one_line())
        sys.exit(2)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's peak RSS")
def test_the_gate_pass_admits_each_layer_and_stays_inside_the_smallest_share_it_names(tmp_path: Path) -> None:
    import json

    # layers of 4.7 MB in bfloat16 each (the pass's dtype): a whole model's worth more than one layer's
    model = make_model(tmp_path / "base", ModelSpec(layers=6, hidden=384, intermediate=1536, vocab=64,
                                                    shard_bytes=1 << 30), seed=3)
    prompts = json.dumps(PROMPTS)
    refused = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(tmp_path / "refused"), "1", prompts],
                             capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "the prompt forward pass needs" in refused.stdout
    assert not list((tmp_path / "refused" / "pass").glob("layer-*"))  # refused before its first layer
    share = parse_size(refused.stdout.rsplit("--max-memory ", 1)[1].split()[0])
    code, _, held, err = peak_rss_and_held_run([sys.executable, "-c", _CHILD, str(model), str(tmp_path / "ran"),
                                                str(share), prompts])
    assert code == 0, err
    assert (tmp_path / "ran" / "pass" / "routers.safetensors").is_file()
    # what the MoE run's own budget test measures of the pass's process (its anonymous and shared pages, sampled)
    assert held <= share, f"the pass held {held / 1e6:.0f} MB, over its {share / 1e6:.0f} MB share"


def test_the_gate_pass_reserves_its_embeddings_and_every_layer_it_runs(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.config.locations import StateDir
    from resumerge.forward.job import driver
    from resumerge.forward.opening.opened import open_for_pass
    from resumerge.runs.moe import forward

    admitted: list[tuple[str, str]] = []

    class Counted(driver.Admission):  # the pass driver admits each step of the job (forward.GatesJob)
        def __call__(self, what: str, step: str) -> object:  # type: ignore[override]
            admitted.append((what, step))
            return super().__call__(what, step)

    monkeypatch.setattr(driver, "Admission", Counted)
    model = make_model(tmp_path / "base", ModelSpec(layers=3), seed=3)
    ready = forward.pass_checks(model, model, "hidden", PROMPTS)
    opened = open_for_pass(str(model), "base", StateDir.resolve(tmp_path / "state")).opened
    weights = forward.Weights.of(opened.directory, opened.tensors)
    forward.hidden_routers(forward.InThisProcess(weights, "hidden", share=8 << 30, ready=ready), ready.sets,
                           tmp_path / "pass")
    # the last layer's input is the last router's: that layer is never run, so never read
    assert admitted == [("the base's embeddings", "layer"), ("layer 0 of the base", "layer"),
                        ("layer 1 of the base", "layer")]
    admitted.clear()
    forward.hidden_routers(forward.InThisProcess(weights, "hidden", ready=ready), ready.sets, tmp_path / "unadmitted")
    assert admitted == []  # no share: nothing to admit by
