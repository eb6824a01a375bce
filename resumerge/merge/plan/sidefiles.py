"""The output files besides the shards: index, config.json, the config as YAML, the model card, tokenizer files.

Each is a planned, journaled unit like a shard: its name is fixed by the plan, its bytes are a pure function of
the plan (tokenizer files are copied from the tokenizer donor and checked against the hash recorded at plan
time), and it is written with the same temp → fsync → rename → fsync(dir) → ledger row protocol.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from resumerge.errors import PlanChangedError
from resumerge.inputs.files import CONFIG_NAME, INDEX_NAME
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.modelcard import CARD_NAME, render_model_card
from resumerge.merge.plan.outconfig import render_config


@dataclass(frozen=True)
class AuxFile:
    """A non-shard output file: its name, kind (index|config|card|tokenizer) and the kill point of its write."""

    name: str
    kind: str
    point: str


def aux_files(plan: Plan) -> list[AuxFile]:
    """Every non-shard output file of ``plan``, in write order."""
    own = plan.container.side_files()
    if own:  # a plan that makes its own side files (an extracted adapter) writes those alone
        return [AuxFile(name, "config", "during_config_write") for name in own]
    files = []
    container = plan.container  # a GGUF file holds the config and the tokenizer itself
    if container.writes_index(len(plan.shards)):
        files.append(AuxFile(INDEX_NAME, "index", "during_index_write"))
    if not container.self_contained:
        files.append(AuxFile(CONFIG_NAME, "config", "during_config_write"))
    if plan.options.write_model_card:  # mergekit's --no-write-model-card drops both
        files.append(AuxFile(plan.config_copy, "config", "during_config_write"))  # named by the plan's kind
        files.append(AuxFile(CARD_NAME, "card", "during_config_write"))
    files.extend(AuxFile(name, "tokenizer", "during_tokenizer_write") for name, _ in plan.tokenizer_files)
    return files


def render_aux(plan: Plan, aux: AuxFile, config_text: str) -> bytes:
    """The exact bytes of ``aux``. Raises :class:`PlanChangedError` if a tokenizer file changed since planning."""
    own = plan.container.side_files()
    if aux.name in own:
        return own[aux.name]
    if aux.name == INDEX_NAME:
        total = sum(t.nbytes for t in plan.tensors.values())
        doc = {"metadata": {"total_size": total, "format": "pt"}, "weight_map": plan.weight_map}
        return (json.dumps(doc, indent=2) + "\n").encode("utf-8")
    if aux.name == CONFIG_NAME:
        return render_config(plan.out_config)
    if aux.name == plan.config_copy:
        return config_text.encode("utf-8")
    if aux.name == CARD_NAME:
        return render_model_card(plan, config_text)
    if aux.name in plan.tokenizer_blobs:
        return plan.tokenizer_blobs[aux.name]
    assert plan.tokenizer_donor is not None
    source = Path(plan.model_dirs[plan.tokenizer_donor]) / aux.name
    data = source.read_bytes()
    expected = dict(plan.tokenizer_files)[aux.name]
    if hashlib.sha256(data).hexdigest() != expected:
        raise PlanChangedError(
            f"tokenizer file {source} changed since the merge was planned",
            path=str(source),
            hint="restore it, or start over with resumerge run --restart",
        )
    return data
