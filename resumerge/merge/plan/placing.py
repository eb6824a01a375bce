"""The output's files laid out by the container the planner chose (:mod:`resumerge.outputs.containers`): safetensors
shards keep the shards :func:`~resumerge.merge.plan.sharding.assign_shards` made; a GGUF file (or gguf-split's files) is
laid out by :func:`~resumerge.merge.plan.ggufout.gguf_output`, its headers kept on its container. A planner calls
:func:`place_files` once, whatever the container."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.merge_plan import ShardPlan, TensorPlan
from resumerge.outputs.containers import GgufFile, GgufRelease, OutputContainer

Placed = tuple[tuple[ShardPlan, ...], dict[str, TensorPlan], OutputContainer]


def _no_template() -> str | None:
    return None


@dataclass(frozen=True)
class Placing:
    """What laying out an output's files may read: its config.json, the opened inputs, their keys (the donor
    first), the config's chat template (asked only by a container that holds the tokenizer; None: the parent's),
    the tensors that come last (a prompt pass's routers), the bytes of a unit of a file written in place, and the
    key-values a GGUF sets over those made or read (``gguf_keys``: a transplant's name and added tokens)."""

    out_config: Mapping[str, Any]
    models: Mapping[str, ModelInput]
    order: Sequence[str]
    template: Callable[[], str | None] = _no_template
    last: Collection[str] = ()
    unit_size: int | None = None
    gguf_keys: Mapping[str, str | bool | int] = field(default_factory=dict)
    # the output's model name (the config's ``name:``): a GGUF release names its files after it
    name: str | None = None


def place_files(container: OutputContainer, shards: tuple[ShardPlan, ...], tensors: dict[str, TensorPlan],
                placing: Placing) -> Placed:
    """``tensors`` in the files of ``container`` (``shards``: as safetensors shards place them), with the container
    as the plan carries it. Raises :class:`~resumerge.errors.ModelInputError` for what a container cannot write."""
    placer = _PLACERS.get(container.name)
    return (shards, tensors, container) if placer is None else placer(container, tensors, placing)


def _gguf(container: Any, tensors: dict[str, TensorPlan], placing: Placing) -> Placed:
    gguf: GgufFile = container
    shards, placed, headers = _laid_out(tensors, placing)(gguf)
    return shards, placed, replace(gguf, headers=headers)


def _release(container: Any, tensors: dict[str, TensorPlan], placing: Placing) -> Placed:
    from resumerge.merge.plan.ggufrelease import release_output

    name = placing.name or placing.gguf_keys.get("general.name")
    return release_output(container, None if name is None else str(name), _laid_out(tensors, placing))


def _laid_out(tensors: dict[str, TensorPlan], placing: Placing
              ) -> Callable[[GgufFile], tuple[tuple[ShardPlan, ...], dict[str, TensorPlan], dict[str, bytes]]]:
    """How ``tensors`` are laid out in one GGUF file (or gguf-split's files) of a given type and split."""
    from resumerge.merge.plan.ggufout import gguf_output

    template = placing.template()  # asked once: a release lays out a file per type

    def single(gguf: GgufFile) -> tuple[tuple[ShardPlan, ...], dict[str, TensorPlan], dict[str, bytes]]:
        return gguf_output(tensors, placing.out_config, placing.models, list(placing.order), gguf, template,
                           last=placing.last, unit_size=placing.unit_size, keys=placing.gguf_keys)

    return single


# The containers whose files are laid out otherwise than as safetensors shards, by name.
_PLACERS: Mapping[str, Callable[[OutputContainer, dict[str, TensorPlan], Placing], Placed]] = MappingProxyType({
    GgufFile.name: _gguf, GgufRelease.name: _release})
