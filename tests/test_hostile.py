"""Hostile inputs: refused with exit 2 and one clear line, nothing executed, nothing written outside OUT.

Complements tests/test_validation.py (config mistakes, a ``../`` index entry, a fake pickle, one YAML tag) and
tests/test_safetensors_format.py (header parsing unit tests): here every attack goes through the real command
line, and each test snapshots the whole temp tree before and after, so a write anywhere (or a file copied from
outside a model directory into OUT) fails the test. Symbolic links of the files a merge copies into OUT as they are
(config.json, the tokenizer's) that leave a model directory are refused — except a Hugging Face cache snapshot's
links into its own ``blobs`` folder — so a model folder cannot smuggle a private file (``tokenizer.json ->
~/.ssh/id_rsa``) into the output (weights' links are followed: tests/test_linked_folders.py). A symlinked or
non-directory OUT is refused (pass the real directory). Tensor names are never used as paths; control characters
in them are refused so that a name cannot inject lines into logs and error messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ModelFactory
from support import write_config

from resumerge.cli.commands import main


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) -> sha256, link target or "dir"."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = "link:" + os.readlink(path)
            elif path.is_dir():
                found[key] = "dir"
            else:
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: dict[str, Any] | str, *fragments: str,
             out: Path | None = None) -> str:
    """Run ``doc`` into OUT; assert exit 2, one ``error:`` line with every fragment, and no write anywhere."""
    config = tmp_path / "hostile.yml"
    if isinstance(doc, str):
        config.write_text(doc)
    else:
        write_config(config, doc)
    out = out or tmp_path / "out"
    before = _tree(tmp_path)
    code = main(["run", str(config), str(out), "--quiet"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert _tree(tmp_path) == before, "a refused run wrote or changed files"
    assert not Path(os.environ["RESUMERGE_STATE_DIR"]).exists(), "a refused run created state"
    return lines[0]


def _merged(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path) -> Path:
    """Passthrough ``model`` into a new OUT; assert success and that only OUT changed in the temp tree."""
    config = write_config(tmp_path / "ok.yml", {"merge_method": "passthrough", "models": [str(model)]})
    out = tmp_path / "out"
    before = _tree(tmp_path)
    code = main(["run", str(config), str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    after = {k: v for k, v in _tree(tmp_path).items() if k != "out" and not k.startswith("out/")}
    assert after == before
    return out


def _passthrough(model: Path) -> dict[str, Any]:
    return {"merge_method": "passthrough", "models": [str(model)]}


def _first_shard(model: Path) -> Path:
    return sorted(model.glob("model-*.safetensors"))[0]


def _safetensors(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _f32(name: str, shape: list[int], start: int, end: int) -> dict[str, object]:
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": [start, end]}}


# (id, file bytes, fragment of the error line)
HEADERS: list[tuple[str, bytes, str]] = [
    ("length-2^64-1", _safetensors(_f32("a", [2], 0, 8), b"\0" * 8, length=2**64 - 1), "header length"),
    ("length-zero", _safetensors(b"", b"\0" * 8), "not valid JSON"),
    ("not-utf8", _safetensors(b'{"a\xff\xfe": {}}'), "not valid JSON"),
    ("nested-json", _safetensors(b"[" * 200_000 + b"]" * 200_000), "not valid JSON"),
    ("offsets-past-end", _safetensors(_f32("a", [2**30], 0, 2**32), b"\0" * 8), "covers"),
    ("overlapping", _safetensors({**_f32("a", [2], 0, 8), **_f32("b", [2], 4, 12)}, b"\0" * 12), "overlaps"),
    ("dtype-size-lie", _safetensors({"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16),
     "need 8"),
    ("shape-overflow", _safetensors(_f32("a", [2**62, 2**62], 0, 8), b"\0" * 8), "need"),
    ("name-with-newline", _safetensors(_f32("a\nerror: all fine", [2], 0, 8), b"\0" * 8), "control character"),
    ("name-with-nul", _safetensors(_f32("model\u0000.x", [2], 0, 8), b"\0" * 8), "control character"),
    ("metadata-not-strings", _safetensors({"__metadata__": {"format": 1}, **_f32("a", [2], 0, 8)}, b"\0" * 8),
     "__metadata__"),
]


@pytest.mark.parametrize(("label", "blob", "fragment"), HEADERS, ids=[h[0] for h in HEADERS])
def test_lying_safetensors_headers_are_refused(tmp_path: Path, make: ModelFactory,
                                               capsys: pytest.CaptureFixture[str], label: str, blob: bytes,
                                               fragment: str) -> None:
    model = make("a")
    shard = _first_shard(model)
    shard.write_bytes(blob)
    line = _refused(tmp_path, capsys, _passthrough(model), fragment, shard.name)
    assert "\\n" in line or "newline" not in label


def _set_index_entry(model: Path, value: object) -> None:
    index = model / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    doc["weight_map"][first] = value
    index.write_text(json.dumps(doc))


@pytest.mark.parametrize(("value", "fragment"), [
    ("/etc/passwd", "escapes the model directory"),
    ("/tmp/elsewhere/model-00001-of-00004.safetensors", "escapes the model directory"),
    ("..\\..\\model-00001-of-00004.safetensors", "escapes the model directory"),
    ("model\u0000-00001-of-00004.safetensors", "escapes the model directory"),
    (42, "escapes the model directory"),
    ("pytorch_model.bin", "not a .safetensors file"),
], ids=["absolute", "absolute-safetensors", "backslashes", "nul", "not-a-string", "pickle-file"])
def test_index_entries_that_escape_are_refused(tmp_path: Path, make: ModelFactory,
                                               capsys: pytest.CaptureFixture[str], value: object,
                                               fragment: str) -> None:
    model = make("a")
    _set_index_entry(model, value)
    _refused(tmp_path, capsys, _passthrough(model), fragment, "model.safetensors.index.json")


def test_index_nested_too_deep_is_refused(tmp_path: Path, make: ModelFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model = make("a")
    (model / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    _refused(tmp_path, capsys, _passthrough(model), "index is not valid JSON")


def _move_out_and_link(path: Path, outside: Path) -> None:
    outside.parent.mkdir(parents=True, exist_ok=True)
    path.rename(outside)
    path.symlink_to(outside)


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "tokenizer_config.json",
                                  "special_tokens_map.json"])
def test_symlinks_leading_out_of_the_model_dir_are_refused(tmp_path: Path, make: ModelFactory,
                                                           capsys: pytest.CaptureFixture[str], name: str) -> None:
    """e.g. ``tokenizer.json -> ~/.ssh/id_rsa``: a file a merge copies into OUT as it is, refused before anything
    is read, so nothing reaches OUT. (Weights and their index are read as tensors, never copied: their links are
    followed — tests/test_linked_folders.py.)"""
    model = make("a")
    _move_out_and_link(model / name, tmp_path / "outside" / name)
    _refused(tmp_path, capsys, _passthrough(model), "symbolic link", "outside the model directory", name)


def test_a_tokenizer_link_to_a_private_file_never_reaches_out(tmp_path: Path, make: ModelFactory,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    model = make("a")
    secret = tmp_path / "home" / ".ssh" / "id_rsa"
    secret.parent.mkdir(parents=True)
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(secret)
    _refused(tmp_path, capsys, _passthrough(model), "tokenizer.json", str(secret))


def test_symlink_loop_is_refused(tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    model = make("a")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(model / "tokenizer.json")
    _refused(tmp_path, capsys, _passthrough(model), "symbolic link loop")


def test_links_inside_the_model_dir_and_hub_snapshot_links_are_fine(tmp_path: Path, make: ModelFactory,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Hugging Face cache snapshots are folders of links into ``../../blobs``; links within a folder are harmless."""
    snapshot = make("repo/snapshots/0123abcd")
    blobs = snapshot.parent.parent / "blobs"
    blobs.mkdir()
    for path in sorted(snapshot.iterdir()):
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        path.rename(blob)
        path.symlink_to(Path("../../blobs") / blob.name)
    (snapshot / "tokenizer.json").rename(snapshot / "tok-real.json")
    (snapshot / "tokenizer.json").symlink_to("tok-real.json")
    out = _merged(tmp_path, capsys, snapshot)
    assert (out / "tokenizer.json").read_bytes() == (snapshot / "tok-real.json").read_bytes()
    assert not (out / "tokenizer.json").is_symlink()


def test_odd_file_names_in_a_model_dir_are_never_copied(tmp_path: Path, make: ModelFactory,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Output names come from the plan, never from a directory listing: files named like tokenizer files, a
    directory named like one, and a tokenizer config pointing at ``../../`` paths change nothing in OUT."""
    model = make("a")
    outside = tmp_path / "secret.txt"
    outside.write_text("private")
    (model / "..tokenizer.json").write_text("{}")
    (model / "tokenizer.json.bak").write_text("{}")
    (model / ".hidden.safetensors").write_bytes(b"junk")
    (model / "merges.txt").mkdir()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_file="../../secret.txt", vocab_file="/etc/passwd")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = _merged(tmp_path, capsys, model)
    names = {p.name for p in out.iterdir()}
    assert names >= {"config.json", "tokenizer.json", "tokenizer_config.json", "resumerge-manifest.json"}
    assert not names & {"..tokenizer.json", "tokenizer.json.bak", ".hidden.safetensors", "merges.txt",
                        "secret.txt", "passwd", "vocab.txt"}
    assert all(p.is_file() and not p.is_symlink() for p in out.iterdir())
    assert b"private" not in b"".join(p.read_bytes() for p in out.iterdir())


class _Payload:
    """Unpickling this creates ``marker`` (a real code-execution payload, harmless here)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return open, (str(self.marker), "w")


def _malicious_pickle(marker: Path, probe: Path) -> bytes:
    """A pickle that creates ``marker`` when loaded; proven live by loading a twin that creates ``probe``."""
    pickle.loads(pickle.dumps(_Payload(probe))).close()  # the point: show that the payload really runs
    assert probe.exists()
    probe.unlink()
    return pickle.dumps(_Payload(marker))


def test_pickle_only_model_is_refused_and_never_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 1}')
    (model / "pytorch_model.bin").write_bytes(_malicious_pickle(marker, tmp_path / "probe"))
    _refused(tmp_path, capsys, _passthrough(model), "pytorch_model.bin", "zip-format")  # a bare pickle: legacy
    assert not marker.exists()


class _Custom:
    """A custom class whose unpickling creates the marker file named by its state."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __getstate__(self) -> str:
        return self.marker

    def __setstate__(self, state: str) -> None:
        Path(state).touch()


def _torch_payloads(marker: Path) -> dict[str, dict[str, object]]:
    import torch

    return {"code": {"w": torch.ones(2), "x": _Payload(marker)}, "custom-class": {"w": _Custom(marker)}}


# (id, what goes in each .bin file, fragment of the error line)
BINS: list[tuple[str, str, str]] = [
    ("code", "code", "weights-only loader refuses"),
    ("custom-class", "custom-class", "weights-only loader refuses"),
    ("code-in-second-shard", "code", "weights-only loader refuses"),
    ("legacy-non-zip", "legacy", "zip-format"),
    ("state-dict-wrapper", "wrapped", "unwrapped first"),
]


@pytest.mark.parametrize(("label", "payload", "fragment"), BINS, ids=[b[0] for b in BINS])
def test_malicious_bin_checkpoints_are_refused_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], label: str, payload: str, fragment: str
) -> None:
    """Zip-format ``.bin`` files go through PyTorch's weights-only loader: code and custom classes are refused
    before they run (each payload is first shown to be live with an unrestricted load of a twin)."""
    import torch

    marker, probe = tmp_path / "pwned", tmp_path / "probe"
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 1}')
    good = {"model.layers.0.w": torch.ones(2)}
    if payload in ("code", "custom-class"):
        torch.save(_torch_payloads(probe)[payload], tmp_path / "twin.bin")
        live = torch.load(tmp_path / "twin.bin", weights_only=False)  # the point: an unrestricted load runs it
        if payload == "code":
            live["x"].close()
        assert probe.exists()
        probe.unlink()
        (tmp_path / "twin.bin").unlink()
        bad: object = _torch_payloads(marker)[payload]
    else:
        bad = {"state_dict": good} if payload == "wrapped" else good
    legacy = {"_use_new_zipfile_serialization": False} if payload == "legacy" else {}
    if label == "code-in-second-shard":
        torch.save(good, model / "pytorch_model-00001-of-00002.bin")
        torch.save(bad, model / "pytorch_model-00002-of-00002.bin")
        (model / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
            "model.layers.0.w": "pytorch_model-00001-of-00002.bin", "x": "pytorch_model-00002-of-00002.bin"}}))
    else:
        torch.save(bad, model / "pytorch_model.bin", **legacy)
    _refused(tmp_path, capsys, _passthrough(model), fragment)
    assert not marker.exists()


def test_pickle_disguised_as_safetensors_is_refused(tmp_path: Path, make: ModelFactory,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    model = make("a")
    _first_shard(model).write_bytes(_malicious_pickle(marker, tmp_path / "probe"))
    _refused(tmp_path, capsys, _passthrough(model), "safetensors")
    assert not marker.exists()


def test_pickles_beside_safetensors_are_ignored(tmp_path: Path, make: ModelFactory,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Hub repos often ship both formats: the safetensors are merged, the pickles are never opened or copied."""
    marker = tmp_path / "pwned"
    model = make("a")
    payload = _malicious_pickle(marker, tmp_path / "probe")
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt", "tokenizer.pkl"):
        (model / name).write_bytes(payload)
    out = _merged(tmp_path, capsys, model)
    assert not marker.exists()
    assert not [p.name for p in out.iterdir() if p.suffix in {".bin", ".pt", ".pkl"}]


@pytest.mark.parametrize("doc", [
    "merge_method: linear\nmodels:\n  - model: !!python/object/new:os.system ['touch {marker}']\n",
    "merge_method: linear\nmodels:\n  - model: a\n    parameters: {{weight: !!python/name:os.system }}\n",
    "merge_method: !!python/module:os\nmodels: [a]\n",
    "merge_method: linear\nmodels:\n  - model: !include /etc/passwd\n",
    "merge_method: linear\nbase_model: !!python/object/apply:subprocess.call [['touch', '{marker}']]\nmodels: [a]\n",
], ids=["object-new", "name", "module", "custom-tag", "apply-in-base-model"])
def test_yaml_tags_never_construct_objects(tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: str) -> None:
    marker = tmp_path / "pwned"
    _refused(tmp_path, capsys, doc.format(marker=marker), "not valid YAML")
    assert not marker.exists()


def test_yaml_alias_bomb_is_refused_quickly(tmp_path: Path, make: ModelFactory,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Nine levels of nine aliases (387 million leaves if expanded) inside a parameter must fail fast."""
    model = make("a")
    levels = ['&l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    doc = f"merge_method: linear\nmodels:\n  - model: {model}\n    parameters:\n      weight: [{', '.join(levels)}]\n"
    started = time.monotonic()
    _refused(tmp_path, capsys, doc, "models[0].parameters.weight")
    assert time.monotonic() - started < 20


def test_out_that_is_a_symlink_is_refused(tmp_path: Path, make: ModelFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "out-link"
    link.symlink_to(target)
    _refused(tmp_path, capsys, _passthrough(make("a")), "is a symbolic link", str(target), out=link)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    _refused(tmp_path, capsys, _passthrough(make("a")), "is a symbolic link", out=dangling)
    assert not (tmp_path / "nowhere").exists()


def test_out_that_is_a_file_is_refused(tmp_path: Path, make: ModelFactory,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    _refused(tmp_path, capsys, _passthrough(make("a")), "is not a directory", out=out)
    assert out.read_bytes() == b"precious"


def test_resume_into_a_symlinked_out_is_refused(tmp_path: Path, make: ModelFactory,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = _merged(tmp_path, capsys, make("a"))
    link = tmp_path / "out-link"
    link.symlink_to(out)
    before = _tree(tmp_path)
    assert main(["resume", str(link), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is a symbolic link" in err and len(err.splitlines()) == 1
    assert _tree(tmp_path) == before
