"""The Colab notebook runs headlessly end to end, and its single "after a disconnect" cell finishes a merge
whose runtime died: the merge process is SIGKILLed mid-merge, the kernel is shut down and the local state dir
deleted (what a Colab runtime reset does), and a fresh kernel's resume cell ends byte-identical to an
uninterrupted run. Drive and the hub are swapped for temp dirs through injected parameters (as papermill does).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from conftest import ModelFactory
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from support import digests

import resumerge

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "colab" / "resumerge.ipynb"
SHARD_SIZE = "30k"
# The cells a new runtime re-runs before the resume cell (parameters first, then the injected overrides).
AFTER_RESET = ("parameters", "injected-parameters", "install", "drive", "resume")
FIRST_RUN = ("parameters", "injected-parameters", "install", "drive", "config", "plan", "run")
# Jupyter kernels set FORCE_COLOR, so commands run from a cell colour their output; assertions read the text.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _notebook(overrides: dict[str, object]) -> nbformat.NotebookNode:
    """The notebook with an ``injected-parameters`` cell right after the ``parameters`` cell."""
    nb: nbformat.NotebookNode = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = nbformat.v4.new_code_cell(  # type: ignore[no-untyped-call]
        "\n".join(f"{k} = {v!r}" for k, v in overrides.items()))
    injected.metadata["tags"] = ["injected-parameters"]
    injected.id = "injected-parameters"
    nb.cells.insert(index + 1, injected)
    return nb


def _execute(nb: nbformat.NotebookNode, cell_ids: tuple[str, ...], workdir: Path) -> list[tuple[str, str]]:
    """Run ``cell_ids`` in order in one fresh ``python3`` kernel; return (cell id, text output) per cell run.

    A cell that raises ends the run; its error text follows as ``("error", text)``.
    """
    client = NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(workdir)}})
    texts: list[tuple[str, str]] = []
    with client.setup_kernel():
        for cell_id in cell_ids:
            index, cell = next((i, c) for i, c in enumerate(nb.cells) if c.id == cell_id)
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as exc:
                texts.append((cell_id, _text(cell)))
                texts.append(("error", str(exc)))
                break
            texts.append((cell_id, _text(cell)))
    return texts


def _text(cell: nbformat.NotebookNode) -> str:
    return ANSI.sub("", "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"))


def test_notebook_merges_and_its_resume_cell_survives_a_runtime_death(
    tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = make("a", seed=1, layers=6), make("b", seed=2, layers=6)
    config = f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.3}}\n" \
             f"  - model: {b}\n    parameters: {{weight: 0.7}}\ndtype: float32\n"
    reference = tmp_path / "reference"
    resumerge.run(config, reference, out_shard_size=SHARD_SIZE, state_dir=tmp_path / "reference-state")

    drive, state = tmp_path / "drive", tmp_path / "content" / "resumerge-state"
    out = drive / "merged"
    drive.mkdir()
    nb = _notebook({"OUT": str(out), "STATE_DIR": str(state), "CONFIG_PATH": str(tmp_path / "merge.yml"),
                    "CONFIG": config, "USE_DRIVE": False, "INSTALL": False, "OUT_SHARD_SIZE": SHARD_SIZE,
                    "UPLOAD_REPO": None})
    # The kernel and every command it starts import this checkout's resumerge.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # The merge process kills itself (SIGKILL) right after committing its third file, as a runtime death would.
    monkeypatch.setenv("RESUMERGE_KILL_AT", "after_manifest_write:3")
    first = dict(_execute(nb, FIRST_RUN, tmp_path))
    assert "fits" in first["plan"], first
    assert "exit code -9" in first.get("error", ""), first
    shards = {p.name for p in out.glob("model-*.safetensors")}
    assert 3 <= len(shards) < len([n for n in digests(reference) if n.startswith("model-")])

    # A runtime reset: a new kernel, and the VM's local disk (the state dir) is gone; Drive (OUT) survived.
    # The resume cell runs twice: it finishes the merge, then (already done) only reports the status.
    shutil.rmtree(state)
    monkeypatch.delenv("RESUMERGE_KILL_AT")
    second = _execute(nb, (*AFTER_RESET, "resume"), tmp_path)
    assert [cell for cell, _ in second] == [*AFTER_RESET, "resume"], second
    finished, again = second[-2][1], second[-1][1]
    assert "ledger rebuilt from resumerge-manifest.json" in finished, finished
    assert ": done (from the ledger)" in finished, finished
    assert "merging" not in again and ": done (from the ledger)" in again, again
    assert digests(out) == digests(reference)
