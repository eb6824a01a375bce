"""``check --base``'s departure of a step is taken on the base's input to it as the base's forward gives it.

Where the forward computes a step's input from earlier outputs rather than handing it the previous step's output as
it is (XLM with ``causal: true``, followed part by part: its layer_norm1 takes the attention's input plus its output,
its layer_norm2 the feed-forward's input plus its output), the merge's step was given the base's previous step's
output as it is, the residual sum skipped: its departure measured another function. So with a loop's start (Dory:
the normed output plus the normed input section's output). The figures here are those of
transformers' own forward of the base, each part's input and output hooked, the merge's part run on that input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from census import make_census_model
from raycluster import RayHead, ray_cluster
from raystandin import StandInRay
from support import ONE_THREAD, cli, one_thread

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model, write_tokenizer

pytest.importorskip("transformers")
RAY_SPARE_NODES = True  # tests/conftest.py: this module's Ray test takes the spare nodes the others left

TEXT = "the cat sat on the mat"


def hooked_departures(merge: Path, base: Path, family: str) -> dict[int, float]:
    """Per step whose module is a function of what it is called with (XLM: layer_norm1, ffns, layer_norm2 of each
    layer, steps 1, 2, 3 of its four; Dory: every call of its layers), ‖merge's module − base's‖ / ‖base's − its
    input‖, called as the base's forward calls it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(base)(TEXT, return_tensors="pt")["input_ids"]
    base_model, merge_model = (AutoModelForCausalLM.from_pretrained(m).eval() for m in (base, merge))
    parts = ("layer_norm1", "ffns", "layer_norm2") if family == "xlm" else ("layers",)
    inner = base_model.transformer if family == "xlm" else base_model.model
    seen: list[tuple[str, int, Any, Any]] = []
    hooks = [module.register_forward_pre_hook(lambda _m, args, kwargs, key=(part, i): seen.append((*key, args, kwargs)),
                                              with_kwargs=True)
             for part in parts for i, module in enumerate(getattr(inner, part))]
    found = {}
    with torch.no_grad():
        base_model(ids, use_cache=False)
        for hook in hooks:  # (each module run again below)
            hook.remove()
        for k, (part, i, args, kwargs) in enumerate(seen):
            own, theirs = (getattr(m.transformer if family == "xlm" else m.model, part)[i](*args, **kwargs)
                           for m in (base_model, merge_model))
            step = 4 * i + 1 + parts.index(part) if family == "xlm" else k
            found[step] = float((theirs - own).norm() / (own - args[0]).norm())
    return found


@pytest.mark.slow
# XLM: the residual sums before its norms; Dory (one input layer, two looped twice, one output layer): each loop's
# start, the normed output plus the normed input section's output (steps 1 and 3)
@pytest.mark.parametrize(("family", "steps", "hooked"), [("xlm", 16, 12), ("dory", 6, 6)])
def test_check_base_departures_are_taken_on_the_input_the_bases_forward_gives_each_step(
    tmp_path: Path, family: str, steps: int, hooked: int
) -> None:
    merge, base = (make_census_model(tmp_path / role, family, seed) for role, seed in (("merge", 1), ("base", 2)))
    for model in (merge, base):
        write_tokenizer(model, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXT + "\n")  # (one text: no padding, every position real in both)
    report = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    depart = json.loads(json.dumps(report.to_json()))["models"][1]["depart"]
    expected = hooked_departures(merge, base, family)
    assert len(depart) == steps and len(expected) == hooked
    # (before, XLM's norms' were off: layer 0's layer_norm1 1.3438 for 1.3447, layer 1's 1.3414 for 1.0736; the
    # feed-forwards' were right: they take the norm's output as it is)
    assert {k: round(depart[k], 5) for k in expected} == {k: round(v, 5) for k, v in expected.items()}


@pytest.mark.slow
def test_a_check_base_of_xlm_on_ray_killed_at_a_norm_resumes_to_the_local_and_hooked_report(
    tmp_path: Path, ray_head: RayHead
) -> None:
    # (the base's residual sum is computed by its actor, which holds its earlier outputs; killed after step 5, layer
    # 1's layer_norm1, and resumed by a new driver: its actors hold the journaled outputs put back, step 7 its sum)
    pytest.importorskip("ray")
    merge, base = (make_census_model(tmp_path / role, "xlm", seed) for role, seed in (("merge", 1), ("base", 2)))
    for model in (merge, base):
        write_tokenizer(model, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXT + "\n")
    with one_thread():
        local = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "local"))
    with pytest.MonkeyPatch.context() as settings:  # (the settings the spare nodes started with)
        settings.setenv("HF_HUB_OFFLINE", "1")
        settings.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        with ray_cluster(ray_head, workers=2, spare=True) as (cluster, _):
            argv = ["check", merge, "--base", base, "--prompts", texts, "--json", "--state-dir", tmp_path / "s",
                    "--executor", "ray", "--ray-address", cluster.address]
            killed = cli(*argv, env={"RESUMERGE_KILL_AT": "after_check_layer:5"}, timeout=600, script=ONE_THREAD)
            assert killed.returncode == -9, killed.stderr[-2000:]
            resumed = cli(*argv, timeout=600, script=ONE_THREAD)
    assert resumed.returncode == local.exit_code, resumed.stderr[-2000:]
    doc, same = json.loads(resumed.stdout), json.loads(json.dumps(local.to_json()))
    doc.pop("chart"), same.pop("chart")
    assert doc == same
    expected = hooked_departures(merge, base, "xlm")
    assert {k: round(doc["models"][1]["depart"][k], 5) for k in expected} == {k: round(v, 5) for k, v in
                                                                                expected.items()}


class _Asked:
    """A :class:`~resumerge.forward.placing.modelnode.ModelNode` in this process as the driver calls a Ray actor
    (``actor.method.remote(...)``, arguments and results pickled as Ray sends them), each call's method and layer
    logged in ``asked``."""

    def __init__(self, node: Any, asked: list[tuple[str, int | None]]) -> None:
        self._node, self._asked = node, asked

    def __getattr__(self, name: str) -> Any:
        import pickle
        from types import SimpleNamespace

        method = getattr(self._node, name)

        def remote(*args: Any) -> Any:
            self._asked.append((name, args[0] if name in ("layer", "entered") else None))
            return pickle.loads(pickle.dumps(method(*pickle.loads(pickle.dumps(args)))))

        return SimpleNamespace(remote=remote)


# XLM's steps per layer: attention, layer_norm1 (given the attention's input plus its output), the feed-forward,
# layer_norm2 (given the feed-forward's input plus its output): the norms' inputs are computed, steps 4i+1 and 4i+3.
# The llama-like model's every layer takes the previous one's output as it is.
@pytest.mark.parametrize(("family", "computed"), [("xlm", {1, 3, 5, 7, 9, 11, 13, 15}), ("llama", set())])
def test_a_check_base_on_ray_asks_the_base_s_actor_for_its_input_only_at_the_steps_its_forward_computes(
    tmp_path: Path, family: str, computed: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # (each other step's input is the base's last output, which the driver holds: the actor was asked at every step,
    # a round trip that came back with nothing)
    from dataclasses import replace

    import resumerge.machine.rayconnect
    from resumerge.config.locations import StateDir
    from resumerge.forward.compared.passes import forward_pass, run_pass, streams_of
    from resumerge.forward.opening.opened import open_for_pass
    from resumerge.forward.placing.modelnode import ModelNode
    from resumerge.forward.placing.onray import Place, sent
    from resumerge.forward.placing.rayactor import RayModels

    monkeypatch.setattr(resumerge.machine.rayconnect, "this_node", lambda: "0123abcd")  # (no Ray node here)
    made = {"merge": 1, "base": 2}
    folders = [make_census_model(tmp_path / role, "xlm", seed) if family == "xlm" else
               make_model(tmp_path / role, ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64), seed=seed)
               for role, seed in made.items()]
    models = [replace(open_for_pass(str(folder), role, StateDir.resolve(tmp_path / "s")), role=role)
              for folder, role in zip(folders, made)]
    sequences = [[1, 5, 9, 13, 2], [3, 4, 5]]
    with one_thread():
        streams = streams_of(models)
        try:
            local = forward_pass(models, streams, sequences, tmp_path / "local")
        finally:
            for stream in streams:
                stream.close()
        asked: list[tuple[str, int | None]] = []
        nodes = [ModelNode(sent(model), 1) for model in models]
        running = RayModels(StandInRay(), models, [Place("node", 1.0, 0)] * 2, nodes[0].stream.layers)
        running.actors, running.nodes = [_Asked(node, asked) for node in nodes], ["node", "node"]
        try:
            on_ray = run_pass(list(made), running, sequences, tmp_path / "ray")
        finally:
            for node in nodes:
                node.close()
    assert on_ray == local and local is not None and len(local.depart[1]) == (16 if family == "xlm" else 3)
    assert [index for name, index in asked if name == "entered"] == sorted(computed)
    assert [index for name, index in asked if name == "layer"] == [i for i in range(len(local.depart[1]))
                                                                    for _ in made]
