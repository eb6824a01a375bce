from __future__ import annotations

from pathlib import Path

from families import FAMILIES, make_family_model
from support import cli, linear_config, write_config


def test_a_plain_mixtral_merge_shows_no_forward_pass(tmp_path: Path) -> None:
    """Issue 60 item 5: an MoE pass folder in the state dir (here an empty one) is another run's: the status of a
    plain merge of Mixtral models (whose routers end in ``.gate.weight``) says nothing of a forward pass."""
    mixtral = next(f for f in FAMILIES if f.name == "mixtral")
    a, b = (make_family_model(tmp_path / name, mixtral, seed) for name, seed in (("a", 1), ("b", 2)))
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", cfg, out, "--state-dir", state, "--out-shard-size", "20k", "-q",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:1"})
    assert killed.returncode == -9, killed.stderr
    (state / "moe-routers" / "0123abcd").mkdir(parents=True)
    shown = cli("status", out, "--state-dir", state)
    assert shown.returncode == 0 and "interrupted" in shown.stdout, shown.stdout
    assert "forward pass" not in shown.stdout, shown.stdout
    assert cli("status", out, "--state-dir", state, "--json").stdout.count('"prepass_layers": null') == 1
