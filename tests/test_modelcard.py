"""The output's README.md model card: exact content for local and hub-pinned merges, determinism, journaling."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash
from conftest import ModelFactory
from hub.fakehub import FakeHub, files_of
from huggingface_hub import close_session, constants
from support import cli, cli_here, digests, loopback_only

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.methods import get_method, method_names
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.modelcard import _method_line, hub_commit, render_model_card

SHA = "0123456789abcdef0123456789abcdef01234567"
INTRO = ("This is a merge of pre-trained language models, made with resumerge from a "
         "[mergekit](https://github.com/arcee-ai/mergekit) configuration.")


def _stack_config(a: Path, b: Path) -> str:
    return f"""name: tiny-stack
merge_method: passthrough
slices:
  - sources:
      - model: {a}
        layer_range: [0, 3]
  - sources:
      - model: {b}
        layer_range: [1, 4]
"""


def test_local_card_content(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    (a / "README.md").write_text("# the donor's own card\n")
    text = _stack_config(a, b)
    cfg = tmp_path / "c.yml"
    cfg.write_text(text)
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0
    expected = f"""---
library_name: transformers
tags:
- mergekit
- merge
- resumerge
---
# tiny-stack

{INTRO}

## Merge method

Passthrough (`passthrough`): tensors copied unchanged (optionally scaled) from the listed layers, e.g. to stack \
layers of one or more models.

## Models

- `{a}` (local)
- `{b}` (local)

## Layers

The output has 6 layers:

- layers 0–2: `{a}` layers [0, 3)
- layers 3–5: `{b}` layers [1, 4)

## Input tensors

78 input tensors: 0 merged, 30 copied, 27 renumbered, 21 dropped (layers outside the slices: 18; post-layer \
tensors come from the last slice's models: 2; pre-layer tensors come from the first slice's models: 1).

## Configuration

The following YAML configuration was used to produce this model:

```yaml
{text}```
"""
    assert (out / "README.md").read_text() == expected  # the donor's README.md is never copied


def test_hub_pinned_card_from_a_plan(tmp_path: Path, make: ModelFactory) -> None:
    local = make("local", seed=3)
    text = f"""merge_method: slerp
base_model: {local}
parameters:
  t: 0.5
models:
  - model: {local}
  - model: org/alpha@main
"""
    # The plan a hub run makes: org/alpha's directory is its cache snapshot at the pinned commit.
    plan = plan_from_config(load_config_text(text.replace("org/alpha@main", str(local))), PlanOptions())
    snapshot = f"/cache/hub/models--org--alpha/snapshots/{SHA}"
    plan = replace(plan, model_dirs={str(local): str(local), "org/alpha@main": snapshot})
    card = render_model_card(plan, text).decode()
    assert card.startswith("---\nbase_model:\n- org/alpha\nlibrary_name: transformers\ntags:\n- mergekit\n")
    assert "# Merged model\n" in card
    assert ("[SLERP](https://en.wikipedia.org/wiki/Slerp) (`slerp`): spherical linear interpolation between two "
            "models, from the base (t = 0) to the other model (t = 1).\n") in card
    assert (f"## Models\n\n- `{local}` (local, base model)\n"
            f"- [org/alpha](https://huggingface.co/org/alpha), revision `main`, "
            f"commit [`{SHA}`](https://huggingface.co/org/alpha/tree/{SHA})\n\n## Input tensors") in card
    assert "## Layers" not in card  # a models: merge keeps the layers as they are
    assert card.endswith(f"```yaml\n{text}```\n")
    assert render_model_card(plan, text) == card.encode()


def test_every_method_a_config_may_name_describes_itself_for_the_card() -> None:
    """The card reads a method's display name and description from its declaration: a new method without them
    would show a bare name."""
    for name in method_names():
        spec = get_method(name)
        assert spec is not None and spec.title and spec.summary.endswith("."), name
    assert _method_line("ties", "TIES", "trims.", "https://arxiv.org/abs/2306.01708") == (
        "[TIES](https://arxiv.org/abs/2306.01708) (`ties`): trims.")
    assert _method_line("x", "x", "", "") == "x (`x`)"


def test_hub_commit_only_for_cache_snapshots_of_that_repo() -> None:
    assert hub_commit("org/alpha", f"/h/hub/models--org--alpha/snapshots/{SHA}") == SHA
    assert hub_commit("gpt2", f"/h/hub/models--gpt2/snapshots/{SHA}") == SHA
    assert hub_commit("org/beta", f"/h/hub/models--org--alpha/snapshots/{SHA}") is None
    assert hub_commit("org/alpha", f"/h/hub/models--org--alpha/snapshots/{SHA[:-1]}") is None
    assert hub_commit("org/alpha", "/work/models/org/alpha") is None
    # A local path that points into the cache is a local model, written as the user wrote it.
    assert hub_commit(f"/h/hub/models--org--alpha/snapshots/{SHA}", f"/h/hub/models--org--alpha/snapshots/{SHA}") \
        is None


def test_config_holding_a_fence_gets_a_longer_one(tmp_path: Path, make: ModelFactory) -> None:
    a = make("a")
    # A block scalar line of backticks would close a ``` fence early (indented up to three spaces it still counts).
    text = (f"merge_method: passthrough\nmodels:\n  - model: {a}\n"
            "chat_template: |\n  {% for m in messages %}\n  ```\n  ````\n  {{ m.content }}\n  {% endfor %}\n")
    plan = plan_from_config(load_config_text(text), PlanOptions())
    card = render_model_card(plan, text).decode()
    assert card.endswith(f"`````yaml\n{text}`````\n")


def test_card_is_journaled_and_byte_identical_after_a_kill(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = tmp_path / "c.yml"
    cfg.write_text(_stack_config(a, b))
    ref, out = tmp_path / "ref", tmp_path / "out"
    # Only the run to kill is a process of its own; the reference and the resume run the CLI here.
    assert main(["run", str(cfg), str(ref), "--quiet"]) == 0
    # The third config-file write is README.md (config.json, mergekit_config.yml, README.md).
    killed = cli("run", cfg, out, "--quiet", env={"RESUMERGE_KILL_AT": "during_config_write:3"})
    assert killed.returncode == -9
    assert not (out / "README.md").exists()
    assert main(["resume", str(out), "--quiet"]) == 0
    assert digests(out) == digests(ref)
    manifest = json.loads((out / "resumerge-manifest.json").read_text())
    assert "README.md" in manifest["planned"]
    card = (out / "README.md").read_bytes()
    assert manifest["committed"]["README.md"]["sha256"] == "xxh3-128:" + xxhash.xxh3_128_hexdigest(card)
    done = cli_here("verify", out, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["ok"] is True
    (out / "README.md").write_text("edited\n")
    damaged = cli_here("verify", out, "--json")
    assert damaged.returncode == 3 and "README.md" in damaged.stdout


# ---- a real merge from a stand-in hub -------------------------------------------------------------------------
@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeHub, str]]:
    """org/alpha on a stand-in hub at 127.0.0.1 with an isolated HF home; yields the hub and the pushed commit."""
    home = tmp_path / "hf_home"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"HF_HOME": home, "HF_HUB_CACHE": home / "hub", "HF_TOKEN_PATH": home / "token",
                       "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}.items():
        monkeypatch.setenv(var, str(value))
    for name, setting in {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
                          "HF_TOKEN_PATH": str(home / "token"), "HF_HUB_OFFLINE": False,
                          "HF_HUB_DISABLE_XET": True}.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, setting)
    loopback_only(monkeypatch)
    files = files_of(make_model(tmp_path / "alpha", ModelSpec(layers=2), seed=0))
    files["README.md"] = b"# alpha's own card\n"
    hub = FakeHub()
    commit = hub.push("org/alpha", files)
    with hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub, commit
    close_session()


def test_hub_merge_card_names_the_pinned_commit(tmp_path: Path, fake_hub: tuple[FakeHub, str]) -> None:
    hub, commit = fake_hub
    local = make_model(tmp_path / "local", ModelSpec(layers=2), seed=7)
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: task_arithmetic\nbase_model: org/alpha\nmodels:\n  - model: org/alpha\n"
                   f"  - model: {local}\n    parameters:\n      weight: 0.7\n")
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["run", str(cfg), str(out), "--state-dir", str(state), "--quiet"]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model:\n- org/alpha\nlibrary_name: transformers\n")
    assert (f"- [org/alpha](https://huggingface.co/org/alpha) (base model), "
            f"commit [`{commit}`](https://huggingface.co/org/alpha/tree/{commit})\n- `{local}` (local)\n") in card
    assert "alpha's own card" not in card
    before = digests(out)
    hub.push("org/alpha", files_of(make_model(tmp_path / "alpha2", ModelSpec(layers=2), seed=5)))
    (out / "README.md").unlink()  # rebuilt on resume from the recorded plan: the same commit, the same bytes
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == before
