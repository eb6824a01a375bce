"""Every input the model card is written from is part of what a continued run is compared with: a run started
again into OUT with a config whose text differs only where the card (and the config's copy) show it, its name or a
comment, is refused in one line rather than finished with a card of other words than the files written before."""

from __future__ import annotations

from pathlib import Path

from conftest import ModelFactory
from support import cli, digests, linear_config, write_config


def test_a_config_renamed_between_a_kill_and_a_run_again_is_refused(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    first = write_config(tmp_path / "first.yml", {"name": "First", **linear_config(a, b)})
    renamed = write_config(tmp_path / "renamed.yml", {"name": "Renamed", **linear_config(a, b)})
    out, state = tmp_path / "out", tmp_path / "state"
    # killed writing the card: config.json and the config's copy (its name "First") are written
    killed = cli("run", first, out, "--state-dir", state, "-q", env={"RESUMERGE_KILL_AT": "during_config_write:3"})
    assert killed.returncode == -9, killed.stderr
    assert "First" in (out / "mergekit_config.yml").read_text() and not (out / "README.md").exists()
    before = digests(out)
    again = cli("run", renamed, out, "--state-dir", state)
    assert again.returncode == 4, again.stderr
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "planned differently" in lines[0] and "name" in lines[0], again.stderr
    assert digests(out) == before
    # the same text goes on (and so does resume, which reads the recorded text)
    assert cli("run", first, out, "--state-dir", state, "-q").returncode == 0
    assert "# First" in (out / "README.md").read_text()


def test_a_comment_is_part_of_the_text_the_card_shows(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    first = write_config(tmp_path / "first.yml", linear_config(a, b))
    commented = tmp_path / "commented.yml"
    commented.write_text("# tuned by hand\n" + first.read_text())
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", first, out, "--state-dir", state, "-q", env={"RESUMERGE_KILL_AT": "during_config_write:3"})
    assert killed.returncode == -9, killed.stderr
    again = cli("run", commented, out, "--state-dir", state)
    assert again.returncode == 4 and "text" in again.stderr, again.stderr
    restarted = cli("run", commented, out, "--state-dir", state, "--restart", "-q")
    assert restarted.returncode == 0, restarted.stderr
    assert "# tuned by hand" in (out / "README.md").read_text()
