"""The Colab notebook runs headlessly end to end, and its single "after a disconnect" cell finishes a merge
whose runtime died: the merge process is SIGKILLed mid-merge, the kernel is shut down and the local state dir
deleted (what a Colab runtime reset does), and a fresh kernel's resume cell ends byte-identical to an
uninterrupted run. Both kinds of OUT go through the same kernels: a Drive folder (a temp dir) and, the notebook's
first choice, an hf:// repo on the stand-in hub (``HF_ENDPOINT`` at it, the token through the notebook's own
``HF_TOKEN`` parameter), resumed from the repo alone. Parameters are injected as papermill does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import ModelFactory
from hub.fakehub import FakeHub
from hub.fakehub_write import HubWriter
from hub.fakehub_xet import XetCas
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from support import digests, hub_digests

import resumerge

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "colab" / "resumerge.ipynb"
SHARD_SIZE = "30k"
# The cells a new runtime re-runs before the resume cell (parameters first, then the injected overrides).
AFTER_RESET = ("parameters", "injected-parameters", "install", "drive", "resume")
FIRST_RUN = ("parameters", "injected-parameters", "install", "drive", "config", "plan", "run")
TOKEN, REPO = "hf_write_alice", "alice/merged"
# Cells the test adds: switch the same kernel to the hf:// OUT; make that merge die after its third upload (before
# any batch commit: the resume must upload only what the hub lacks).
HUB_CELLS = {"hub-out": f"OUT = 'hf://{REPO}'",
             "die-after-upload": "os.environ['RESUMERGE_KILL_AT'] = 'hub_after_upload:3'"}
# Jupyter kernels set FORCE_COLOR, so commands run from a cell colour their output; assertions read the text.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _notebook(overrides: dict[str, object], extra: dict[str, str]) -> nbformat.NotebookNode:
    """The notebook with an ``injected-parameters`` cell right after the ``parameters`` cell, and the ``extra``
    cells (id -> source) at the end."""
    nb: nbformat.NotebookNode = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = nbformat.v4.new_code_cell(  # type: ignore[no-untyped-call]
        "\n".join(f"{k} = {v!r}" for k, v in overrides.items()))
    injected.metadata["tags"] = ["injected-parameters"]
    injected.id = "injected-parameters"
    nb.cells.insert(index + 1, injected)
    for cell_id, source in extra.items():
        cell = nbformat.v4.new_code_cell(source)  # type: ignore[no-untyped-call]
        cell.id = cell_id
        nb.cells.append(cell)
    return nb


def _execute(nb: nbformat.NotebookNode, cell_ids: tuple[str, ...], workdir: Path,
             expect_error: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Run ``cell_ids`` in order in one fresh ``python3`` kernel; return (cell id, text output) per cell run.

    A cell that raises ends the run unless it is the ``expect_error``-th one of its id (counting from 1, as
    ``"run:1"``); its error text follows as ``("error", text)``.
    """
    seen: dict[str, int] = {}
    client = NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(workdir)}})
    texts: list[tuple[str, str]] = []
    with client.setup_kernel():
        for cell_id in cell_ids:
            index, cell = next((i, c) for i, c in enumerate(nb.cells) if c.id == cell_id)
            seen[cell_id] = seen.get(cell_id, 0) + 1
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as exc:
                texts.append((cell_id, _text(cell)))
                texts.append(("error", str(exc)))
                if f"{cell_id}:{seen[cell_id]}" not in expect_error:
                    break
                continue
            texts.append((cell_id, _text(cell)))
    return texts


def _text(cell: nbformat.NotebookNode) -> str:
    return ANSI.sub("", "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"))


def _stand_in_hub(monkeypatch: pytest.MonkeyPatch, home: Path) -> tuple[FakeHub, HubWriter]:
    """A stand-in hub taking uploads, and the environment every kernel and command inherits (an empty HF home).
    Uploads go through Xet, as on Colab (hf-xet is installed there): to the stand-in's ``local://`` CAS."""
    fake = FakeHub()
    writer = HubWriter.attach(fake)
    writer.add_token(TOKEN, "alice")
    writer.cas = XetCas(home.parent / "cas")
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HUB_DISABLE_XET"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"HF_HOME": str(home), "HF_TOKEN_PATH": str(home / "token"), "HF_XET_CACHE": str(home / "xet"),
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
        monkeypatch.setenv(var, value)
    return fake, writer


@pytest.mark.slow
def test_notebook_merges_and_its_resume_cell_survives_a_runtime_death(
    tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = make("a", seed=1, layers=6), make("b", seed=2, layers=6)
    config = f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.3}}\n" \
             f"  - model: {b}\n    parameters: {{weight: 0.7}}\ndtype: float32\n"
    reference = tmp_path / "reference"
    resumerge.run(config, reference, settings=resumerge.Settings(state_dir=tmp_path / "reference-state",
                                                                 output=resumerge.Output(out_shard_size=SHARD_SIZE)))

    drive, state = tmp_path / "drive", tmp_path / "content" / "resumerge-state"
    out, unstarted = drive / "merged", drive / "unstarted"
    drive.mkdir()
    nb = _notebook({"OUT": str(out), "STATE_DIR": str(state), "CONFIG_PATH": str(tmp_path / "merge.yml"),
                    "CONFIG": config, "USE_DRIVE": False, "INSTALL": False, "OUT_SHARD_SIZE": SHARD_SIZE},
                   {**HUB_CELLS, "unstarted-out": f"OUT = {str(unstarted)!r}"})
    # The kernel and every command it starts import this checkout's resumerge.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # The merge process kills itself (SIGKILL) right after committing its third file, as a runtime death would.
    monkeypatch.setenv("RESUMERGE_KILL_AT", "after_manifest_write:3")
    fake, hub = _stand_in_hub(monkeypatch, tmp_path / "hf_home")
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # off Colab the notebook reads the token from the environment
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        # Then the same kernel merges into the hf:// repo, and that process dies after its third upload.
        first = _execute(nb, (*FIRST_RUN, "hub-out", "die-after-upload", "run"), tmp_path,
                         expect_error=frozenset({"run:1", "run:2"}))
        cells = dict(first)
        assert "fits" in cells["plan"], first
        assert len([text for cell, text in first if cell == "error" and "exit code -9" in text]) == 2, first
        shards = {p.name for p in out.glob("model-*.safetensors")}
        assert 3 <= len(shards) < len([n for n in digests(reference) if n.startswith("model-")])
        # Each file is committed once uploaded: at most the two uploads before the death are in the repo.
        committed = set(hub.head_files(REPO)) - {".gitattributes", "resumerge-manifest.json"}
        assert len(committed) <= 2 and all(n.startswith("model-") for n in committed), committed

        # A runtime reset: a new kernel, and the VM's local disk (the state dir, the staged uploads) is gone;
        # Drive and the repo survived. The resume cell runs twice for the Drive OUT: it finishes the merge, then
        # (already done) only reports the status; then once for the repo, which it finishes from the repo alone.
        shutil.rmtree(state)
        monkeypatch.delenv("RESUMERGE_KILL_AT")
        # Then, in the same kernel, an OUT whose runtime died before anything was committed: api.status raised
        # "LedgerError: no merge recorded" there; the cell starts the merge instead.
        cells = (*AFTER_RESET, "resume", "hub-out", "resume", "unstarted-out", "resume")
        second = _execute(nb, cells, tmp_path)
        assert [cell for cell, _ in second] == list(cells), second
        finished, again, from_repo, started = second[-6][1], second[-5][1], second[-3][1], second[-1][1]
        assert "ledger rebuilt from resumerge-manifest.json" in finished, finished
        assert ": done (from the ledger)" in finished, finished
        assert "merging" not in again and ": done (from the ledger)" in again, again
        assert digests(out) == digests(reference)
        assert f"hf://{REPO}: done (from the ledger)" in from_repo, from_repo
        in_repo = {k: hashlib.sha256(v).hexdigest() for k, v in hub.head_files(REPO).items() if k != ".gitattributes"}
        assert in_repo == hub_digests(reference)
        # The uploads before the death: their chunks were not sent again (the resume registered them once more).
        assert hub.cas is not None and not hub.puts and set(hub.cas.registrations()) == {
            v for k, v in in_repo.items() if k.endswith(".safetensors")}
        xorbs = sum(size for name, (size, _) in hub.cas.snapshot().items() if name.startswith("xorbs/"))
        assert xorbs <= 1.02 * sum(len(v) for k, v in hub.head_files(REPO).items() if k.endswith(".safetensors"))
        assert "holds no merge yet" in started and ": done (from the ledger)" in started, started
        assert digests(unstarted) == digests(reference)
        assert all(TOKEN not in text for _, text in first + second)
        assert "Hugging Face token: from the HF_TOKEN environment variable" in dict(first)["install"]


def _wheel(tmp_path: Path) -> Path:
    """A wheel of this checkout (a copy of it, so the build leaves nothing in the tree), standing in for what the
    install cell fetches from the repository URL: built by pyproject's build backend (setuptools.build_meta), the
    hook ``pip wheel --no-build-isolation`` calls, called once (pip's own start and its metadata pass before the
    build took 3.4 of the 5 CPU s)."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "resumerge", source / "resumerge", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    backend = re.search(r'^build-backend = "([\w.]+)"$', (source / "pyproject.toml").read_text(), re.M)
    assert backend, "pyproject.toml names no build backend"
    built = subprocess.run([sys.executable, "-c", f"import sys, {backend[1]} as backend\n"
                            "backend.build_wheel(sys.argv[1])", str(tmp_path / "wheels")],
                           cwd=source, capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr
    return next((tmp_path / "wheels").glob("resumerge-*.whl"))


def test_install_cell_installs_from_the_repository_or_a_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install resumerge` failed: no index has it. The cell installs INSTALL_FROM (a git+https URL or an
    uploaded wheel), and says what to set while it is the placeholder."""
    wheel = _wheel(tmp_path)
    target = tmp_path / "site"
    # pip reads its options from the environment: into a temp folder, this wheel alone, never the network.
    for var, value in {"PIP_TARGET": str(target), "PIP_NO_DEPS": "1", "PIP_NO_INDEX": "1",
                       "PIP_DISABLE_PIP_VERSION_CHECK": "1"}.items():
        monkeypatch.setenv(var, value)
    common = {"STATE_DIR": str(tmp_path / "state"), "USE_DRIVE": False, "INSTALL": True}
    # One kernel: the default first, then the cell run again with INSTALL_FROM set (as a reader who read its error).
    pattern = {"wheel-here": f"INSTALL_FROM = {str(wheel.parent / 'resumerge-*.whl')!r}"}
    ran = _execute(_notebook(common, pattern), ("parameters", "injected-parameters", "install", "wheel-here",
                                                "install"), tmp_path, expect_error=frozenset({"install:1"}))
    # The default looks for an uploaded wheel in /content: none here, so the cell says what to upload or set.
    nothing = ran[:4]
    assert nothing[-1][0] == "error" and "no resumerge wheel matches" in nothing[-1][1], ran
    assert "pip wheel --no-deps -w dist ." in nothing[-1][1] and "INSTALL_FROM" in nothing[-1][1]
    # a new runtime (the resume after a disconnect) has lost the wheel uploaded before: the cell and the resume
    # cell's text say so (issue 87)
    assert "lost the one uploaded before" in nothing[-1][1]
    resume_text = next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                       if c["cell_type"] == "markdown" and "After a disconnect" in "".join(c["source"]))
    assert "upload the resumerge wheel again" in resume_text
    # The default's form, a pattern for an uploaded wheel, with a wheel where it points.
    installed = ran[4:]
    assert [cell for cell, _ in installed] == ["wheel-here", "install"], ran
    assert f"installing resumerge from {wheel}" in installed[-1][1]
    assert (target / "resumerge" / "api" / "__init__.py").is_file() and list(target.glob("resumerge-*.dist-info"))


def test_the_token_comes_from_colabs_secrets_and_is_never_shown(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters cell held the token in plain text. On Colab it is read from the notebook's secrets (a
    stand-in ``google.colab.userdata`` here), before the environment's HF_TOKEN, and no output shows it."""
    secret = "hf_from_the_secrets_panel"
    colab = tmp_path / "fake-colab" / "google" / "colab"  # no google/__init__.py: a namespace portion
    colab.mkdir(parents=True)
    (colab / "__init__.py").write_text("")
    (colab / "userdata.py").write_text(f"def get(name):\n    return {{'HF_TOKEN': {secret!r}}}[name]\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(colab.parents[1]), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    probe = {"probe": "print('the commands get the secret:', os.environ['HF_TOKEN'] == " + repr(secret) + ")"}
    ran = _execute(_notebook({"STATE_DIR": str(tmp_path / "state"), "USE_DRIVE": False, "INSTALL": False}, probe),
                   ("parameters", "injected-parameters", "install", "probe"), tmp_path)
    cells = dict(ran)
    assert "Hugging Face token: from Colab's secrets" in cells["install"], ran
    assert "the commands get the secret: True" in cells["probe"], ran
    assert all(secret not in text and "hf_from_the_environment" not in text for _, text in ran)


@pytest.mark.slow
def test_the_notebook_writes_a_gguf_and_its_check_cell_checks_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The notebook had no ``check`` cell and no GGUF output option (issue 71, item 5): OUT_TYPE "gguf" writes one
    GGUF file of GGUF_TYPE through plan, run and the resume cell, and the check cell checks it against its parents
    (from OUT's record) and says the verdict."""
    from ggufmodels import Q, hf_tensors, to_gguf, write_gguf

    parents = []
    for seed in (1, 2):  # one header (name, type, shapes): the check rebuilds their tokenizer once, the second kept
        parents.append(tmp_path / f"p{seed}" / "model.gguf")
        parents[-1].parent.mkdir()
        write_gguf(parents[-1], "qwen2", to_gguf("qwen2", hf_tensors("qwen2", seed=seed)), Q.F32)
    config = (f"merge_method: linear\nmodels:\n  - model: {parents[0]}\n    parameters: {{weight: 0.3}}\n"
              f"  - model: {parents[1]}\n    parameters: {{weight: 0.7}}\ndtype: float32\n")
    out, state = tmp_path / "drive" / "merged", tmp_path / "state"
    nb = _notebook({"OUT": str(out), "STATE_DIR": str(state), "CONFIG_PATH": str(tmp_path / "merge.yml"),
                    "CONFIG": config, "USE_DRIVE": False, "INSTALL": False, "OUT_TYPE": "gguf",
                    "GGUF_TYPE": "q8_0"}, {})
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ran = _execute(nb, (*FIRST_RUN, "resume", "check"), tmp_path)
    assert [cell for cell, _ in ran] == [*FIRST_RUN, "resume", "check"], ran
    assert (out / "model.gguf").is_file() and not list(out.glob("*.safetensors"))
    assert gguf_types(out / "model.gguf") & {"Q8_0"}
    check = dict(ran)["check"]
    assert re.search(r"check: (the merge works|no effect|broken)", check), check
    assert "## Check" in (out / "README.md").read_text()


def gguf_types(path: Path) -> set[str]:
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
