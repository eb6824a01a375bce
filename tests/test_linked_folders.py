"""A model folder made of symbolic links (issue 71, item 3): the rule is drawn at what reaches OUT.

A file copied into OUT as it is — config.json, a tokenizer or template file — must stay inside its folder (or a
Hugging Face cache's ``blobs``): a cloned repository's ``tokenizer.json -> ~/.ssh/id_rsa`` would copy a private
file into a merge that is then uploaded (tests/test_hostile.py keeps those refused). Weights and their index are
read as tensors and names, never copied, so a link is followed wherever it leads: the layout ``huggingface-cli
download --local-dir`` made before huggingface_hub 0.23, and the one people make to avoid copying 15 GB. A link
to a private file in a weight's place is refused as a damaged weight file, its bytes nowhere. ``check`` and
``measure`` write no file of the model into OUT, so they follow every link.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import ModelFactory
from support import cli_here, write_config

from resumerge.analyses.check.models import open_checked
from resumerge.config.locations import StateDir

_COPIED = {"config.json", "generation_config.json"}  # and every tokenizer file: names starting "tokenizer"


def _link_out(model: Path, store: Path, keep: set[str] | None = None) -> Path:
    """Move each file of ``model`` (but those ``keep`` names) to ``store`` and leave a link to it in its place."""
    store.mkdir(parents=True)
    for path in sorted(model.iterdir()):
        if keep is not None and path.name in keep:
            continue
        path.rename(store / path.name)
        path.symlink_to(store / path.name)
    return model


def _copied_files(model: Path) -> set[str]:
    return {p.name for p in model.iterdir() if p.name in _COPIED or p.name.startswith(("tokenizer", "special"))}


def _digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.name.endswith((".safetensors", ".json")) and p.name != "resumerge-manifest.json"}


def _run(tmp_path: Path, model: Path, name: str) -> tuple[int, str, Path]:
    config = write_config(tmp_path / f"{name}.yml", {"merge_method": "passthrough", "models": [str(model)],
                                                    "dtype": "float32"})
    out = tmp_path / name
    done = cli_here("run", config, out, "--quiet", "--state-dir", tmp_path / "state")
    return done.returncode, done.stderr, out


def test_weights_linked_outside_the_folder_are_followed_and_merge_as_the_copied_folder(
        tmp_path: Path, make: ModelFactory) -> None:
    plain = make("plain", layers=2)
    linked = make("linked", layers=2)
    _link_out(linked, tmp_path / "elsewhere", keep=_copied_files(linked))
    assert any(p.is_symlink() and p.suffix == ".safetensors" for p in linked.iterdir())
    assert (linked / "model.safetensors.index.json").is_symlink()
    code, err, from_plain = _run(tmp_path, plain, "from-plain")
    assert code == 0, err
    code, err, from_linked = _run(tmp_path, linked, "from-linked")
    assert code == 0, err
    assert _digests(from_linked) == _digests(from_plain)
    assert not any(p.is_symlink() for p in from_linked.iterdir())


def test_a_weight_linked_to_a_private_file_is_refused_as_damaged_and_its_bytes_go_nowhere(
        tmp_path: Path, make: ModelFactory) -> None:
    model = make("a", layers=2)
    secret = tmp_path / "home" / ".ssh" / "id_rsa"
    secret.parent.mkdir(parents=True)
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    shard = sorted(model.glob("model-*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(secret)
    code, err, out = _run(tmp_path, model, "out")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "PRIVATE KEY" not in err and "b3BlbnNzaC1rZXktdjEAAAAA" not in err
    assert not out.exists()


def test_a_tokenizer_and_config_linked_outside_are_still_refused_to_a_merge(tmp_path: Path,
                                                                            make: ModelFactory) -> None:
    model = _link_out(make("a", layers=2), tmp_path / "elsewhere")
    code, err, out = _run(tmp_path, model, "out")
    assert code == 2 and "symbolic link" in err and "outside the model directory" in err, err
    assert not out.exists()


def test_check_opens_a_folder_made_of_links_leading_anywhere(tmp_path: Path, make: ModelFactory) -> None:
    """check writes no file of the model anywhere: config and tokenizer links are followed too."""
    model = _link_out(make("a", layers=2), tmp_path / "elsewhere")
    assert (model / "config.json").is_symlink() and (model / "tokenizer.json").is_symlink()
    checked = open_checked(str(model), "MODEL", StateDir.resolve(tmp_path / "state"))
    assert checked.opened.config["model_type"] == "llama" and checked.opened.directory == model


def test_measure_follows_a_folder_made_of_links(tmp_path: Path, make: ModelFactory) -> None:
    pytest.importorskip("transformers")
    a = _link_out(make("a", layers=1, hidden=32, intermediate=48, vocab=64, seed=1), tmp_path / "store-a")
    b = make("b", layers=1, hidden=32, intermediate=48, vocab=64, seed=2)
    (tmp_path / "texts.txt").write_text("The capital of France is Paris.\n")
    config = write_config(tmp_path / "rm.yml", {
        "merge_method": "regmean", "models": [{"model": str(a)}, {"model": str(b)}],
        "parameters": {"grams": str(tmp_path / "grams")}, "dtype": "float32"})
    done = cli_here("measure", config, tmp_path / "grams", "--texts", tmp_path / "texts.txt")
    assert done.returncode == 0, done.stderr
    assert "measured: 2 model(s)" in done.stdout
