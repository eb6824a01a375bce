"""A repeated check is answered from its journal at once (issue 70, item 7): the models' files are looked at (their
headers and sampled identities), never read whole nor hashed whole, and neither torch nor transformers is imported
to give the same report again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
# Reads the report again in a fresh process and says which heavy modules it imported.
_AGAIN = """
import json, sys
from resumerge import api
report = api.check(sys.argv[1], parents=[sys.argv[2]], prompts=sys.argv[3],
                   settings=api.Settings(state_dir=sys.argv[4]))
print(json.dumps({"report": report.to_json(), "imported": sorted(m for m in ("torch", "transformers")
                                                                   if m in sys.modules)}))
"""


def test_a_repeated_check_answers_from_its_report_without_torch(tmp_path: Path) -> None:
    merge, parent = make_model(tmp_path / "m", SPEC, seed=0), make_model(tmp_path / "p", SPEC, seed=1)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n")
    first = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    done = subprocess.run([sys.executable, "-c", _AGAIN, str(merge), str(parent), str(texts), str(tmp_path / "state")],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["imported"] == []
    assert found["report"] == json.loads(json.dumps(first.to_json()))
