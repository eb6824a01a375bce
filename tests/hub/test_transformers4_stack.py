"""resumerge on the stack transformers 4.x pins: the oldest huggingface_hub that pyproject.toml accepts (0.34.0,
the oldest that transformers 4.57 takes: ``huggingface-hub>=0.34.0,<1.0``), transformers 4.57 and its tokenizers.
Installing resumerge into such an environment must leave it alone, and resumerge must work there.

pip installs those versions into a cached ``--target`` folder (once per machine: about 16 MB of wheels); the hub
suite's core runs in a subprocess with the folder first on ``PYTHONPATH``, and a hidden-gates MoE merge (the
prompt forward pass runs in transformers) must give the same bytes as on this environment's stack. Skipped only
when pip cannot reach a package index.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from resumerge import api
from tests.moe import threadpass
from tests.moe.models import llamas
from tests.moe.passthread import passes_on_a_thread
from tests.support import cli, digests

STACK = ("huggingface_hub==0.34.0", "transformers==4.57.6", "tokenizers==0.22.2")
# What huggingface_hub 0.x needs beyond what resumerge's own install brings (module name, requirement), installed
# beside it only where the running environment lacks it.
NEEDS = (("requests", "requests"), ("fsspec", "fsspec>=2023.5.0"), ("tqdm", "tqdm>=4.42.1"),
         ("filelock", "filelock"), ("packaging", "packaging>=20.9"), ("typing_extensions", "typing-extensions"),
         ("regex", "regex"))
# The core: identifying repos and revisions, the checks and records, a merge from the hub, resume offline,
# landing downloads, .bin-only repos. Drops mid-download and hf:// outputs differ on 0.x (CHANGELOG, 0.x line).
CORE = ("test_hub_checks.py", "test_hub_merge.py", "test_hub_bin.py", "test_hub_landing.py")
_OFFLINE = re.compile(r"No matching distribution|Could not find a version|NewConnectionError|Network is "
                      r"unreachable|Temporary failure in name resolution|ProxyError|ConnectTimeout", re.I)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack_env() -> dict[str, str]:
    """The environment of a process that imports the transformers-4 stack first (installed once per machine)."""
    target = Path(tempfile.gettempdir()) / f"resumerge-tests-{'-'.join(STACK).replace('==', '')}"
    if not (target / "transformers").is_dir():
        building = target.with_name(f"{target.name}.{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        missing = [req for module, req in NEEDS if importlib.util.find_spec(module) is None]
        for args in ([*STACK, "--no-deps"], missing):
            if not args:
                continue
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                   "--target", str(building), *args], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                shutil.rmtree(building, ignore_errors=True)
                if _OFFLINE.search(done.stdout + done.stderr):
                    pytest.skip(f"pip cannot reach a package index to install {' '.join(STACK)}")
                raise AssertionError(f"pip install failed:\n{done.stdout}\n{done.stderr}")
        try:
            building.rename(target)
        except OSError:  # another worker installed it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), str(ROOT), env.get("PYTHONPATH")) if p)
    # What a process of that environment would import (found, not imported: an import of both took ~3 CPU s) and
    # the versions it would see; the tests below run them.
    found = subprocess.run([sys.executable, "-c", "import importlib.metadata as m, importlib.util as u; print(*("
                            "f'{m.version(n)}@{u.find_spec(n).origin}' for n in ('huggingface_hub', 'transformers')))"],
                           env=env, capture_output=True, text=True, check=True).stdout.split()
    assert [f.split("@")[0] for f in found] == [STACK[0].split("==")[1], STACK[1].split("==")[1]]
    assert all(Path(f.split("@", 1)[1]).is_relative_to(target) for f in found), found
    return env


@pytest.mark.slow
def test_the_hub_core_passes_on_the_oldest_supported_huggingface_hub(stack_env: dict[str, str]) -> None:
    tests = Path(__file__).resolve().parent
    # Its tests' lines stay out of this run's CPU and fork logs (each counted there twice: its own and this test's)
    env = {name: value for name, value in stack_env.items() if not name.startswith("RESUMERGE_TEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:randomly", "-p",
                           "no:cacheprovider", *(str(tests / name) for name in CORE)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout) and " skipped" not in done.stdout.splitlines()[-1]


@pytest.mark.slow
def test_hidden_gates_on_transformers_4_give_the_same_bytes(tmp_path: Path, stack_env: dict[str, str]) -> None:
    # transformers 4.x names create_causal_mask's input input_embeds and needs the cache positions: the forward
    # pass failed there ("unexpected keyword argument 'inputs_embeds'") after the other shards were committed.
    m = llamas(tmp_path / "models", layers=3)
    config = tmp_path / "moe.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(m[0]), "gate_mode": "hidden", "dtype": "bfloat16",
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab ab", "cd"]},
                    {"source_model": str(m[2]), "positive_prompts": ["ef gh ij"]}]}))
    # The run on the old stack has a process of its own, its transformers the one under test; its pass runs on a thread
    # of that process (threadpass: the same job through the same function, tests/moe/passthread.py), with that
    # transformers, where a process of the pass's own imported torch and it again (~6 CPU s).
    on_4 = cli("run", config, tmp_path / "on-4", "--state-dir", tmp_path / "state-4", env=stack_env,
               script=Path(threadpass.__file__), transformers=True)
    assert on_4.returncode == 0, on_4.stderr
    # This environment's run needs no process of its own, nor does its pass (on a thread of this process): two
    # interpreter starts saved.
    with passes_on_a_thread():
        api.run(config, tmp_path / "here", settings=api.Settings(state_dir=tmp_path / "state"))
    # The manifest holds the plan's fingerprint, whose routers are named by a key that includes the
    # transformers version (a resume on another version recomputes them); every other file is the same.
    on_4_files, here_files = digests(tmp_path / "on-4"), digests(tmp_path / "here")
    assert on_4_files.pop("resumerge-manifest.json") != here_files.pop("resumerge-manifest.json")
    assert on_4_files == here_files and any(name.endswith(".safetensors") for name in here_files)


@pytest.mark.slow
def test_a_base_tokenizer_saved_by_transformers_5_is_refused_by_run_as_by_plan(tmp_path: Path,
                                                                             stack_env: dict[str, str]) -> None:
    # transformers 5 saves tokenizer_class TokenizersBackend, which 4.x lacks: plan refused the hidden gates (exit
    # 2) while run failed at 88 % (exit 3, a shard committed, "finish it with resume", which failed the same way).
    # Both now make the pass's checks through one function, run before its first weight, and the hint names the fix.
    # The run's pass on a thread of its process (threadpass), where transformers 4.57 refuses the tokenizer: a
    # process of its own for the pass (an interpreter start, ~6 CPU s) is plan's here (its probe measures that
    # process), and run's on this stack (tests/moe/test_surface.py).
    m = llamas(tmp_path / "models", layers=3)
    settings = json.loads((m[0] / "tokenizer_config.json").read_text())
    (m[0] / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "TokenizersBackend"}))
    config = tmp_path / "moe.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(m[0]), "gate_mode": "hidden",
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab ab", "cd"]},
                    {"source_model": str(m[2]), "positive_prompts": ["ef gh ij"]}]}))
    out, state = tmp_path / "out", tmp_path / "state"
    planned = cli("plan", config, out, "--state-dir", state, "--probe-size", "0", env=stack_env)
    ran = cli("run", config, out, "--state-dir", state, "--out-shard-size", "30k", env=stack_env,
              script=Path(threadpass.__file__), transformers=True)
    assert (planned.returncode, ran.returncode) == (2, 2), (planned.stderr, ran.stderr)
    said = (f"error: base_model: cannot load the base model's tokenizer from {m[0]}: Tokenizer class "
            "TokenizersBackend does not exist or is not currently imported. — its tokenizer_config.json names "
            "tokenizer_class TokenizersBackend, which transformers 4.57.6 does not have (transformers 5 saved it: "
            "pip install -U 'transformers>=5')")
    assert said in planned.stderr and ran.stderr.startswith(said) and ran.stderr.count("\n") == 1, ran.stderr
    assert not out.exists()
