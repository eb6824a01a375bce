"""Assign output tensors to shards before anything is written.

Greedy by bytes over tensors in name order (mergekit's order, so its shard membership is reproduced): a tensor
joins the current shard unless that would pass the cap and the shard is not empty; a tensor larger than the
cap gets a shard of its own. Names are ``model.safetensors`` for one shard, else numbered like the base (or first)
model's shards (:func:`output_naming`): DeepSeek-V3's ``model-00001-of-000163.safetensors`` (5 and 6 digits), Kimi-K2's
``model-1-of-61.safetensors``, transformers' ``model-00001-of-00004.safetensors`` for any other parent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from resumerge.config.hubtarget import is_hub_target
from resumerge.inputs.safetensors_format import shard_extent
from resumerge.merge.plan.merge_plan import DEFAULT_SHARD_SIZE, PlanOptions, ShardPlan, TensorPlan

# An hf:// OUT's shards by default: sized per run by :func:`hub_shard_size`, from the output's bytes. Each shard is
# uploaded while the next ones are merged, so what the run waits for once the last input byte has landed is the
# upload of the shards that read it, and the upload link idles until the first shard is complete; a kill loses at
# most the shards in flight. Output shards hold tensors in name order, which is not the inputs' file order (a
# Llama's last input file holds lm_head, the last layer's MLP and the final norm), so with large shards those read
# at the end of the download pull tensors read much earlier along with them. Measured hub to hub at 150/75 MB/s on
# the 1.75 GB bench pair (bench/RESULTS.md, session 17): 4.5 s from the last input byte to the last commit with
# 100 MB shards (22 files), 2.6 s with 50 MB, 2.0 s with 25 MB. Smaller shards cost files, not bytes: every file
# is one preupload call in the hub's API quota (1,000 calls in 5 minutes for a free account, hub-real.md) and a
# few round trips a link far from the hub pays per file (the stand-in hub, on 127.0.0.1, does not). So the size
# is about 1/HUB_SHARD_FILES of the output, which bounds the run's files and its API calls whatever the link's
# speed (a 7B fp16 output gets 145 MB shards, a 70B one 1.41 GB), and never below HUB_MIN_SHARD. Nor above
# HUB_MAX_SHARD: the hub advises files under 50 GB (huggingface_hub refuses plain downloads above that), and about
# 5 GB suits range reads and a resume's granularity (hub-real.md), so DeepSeek-V3's 673 GB get 135 files of 5 GB
# (1 GB once: 673 files, as many preupload calls and, past the pacing's 80 an hour, longer commit waits).
HUB_SHARD_FILES = 100
HUB_MIN_SHARD = 25_000_000
HUB_MAX_SHARD = 5_000_000_000
# PlanOptions.out_shard_size when no --out-shard-size was given for an hf:// OUT: the planner picks the size from
# the tensors (hub_shard_size) and the plan it returns records the size picked, so a resume plans the same.
AUTO_SHARD_SIZE = 0
_MB = 1_000_000


def hub_shard_size(tensors: Mapping[str, TensorPlan]) -> int:
    """The shard size of an ``hf://`` OUT's plan when none was asked: about a ``HUB_SHARD_FILES``-th of the output,
    rounded up to whole MB, between ``HUB_MIN_SHARD`` and ``HUB_MAX_SHARD``."""
    total = sum(t.nbytes for t in tensors.values())
    share = -(-total // HUB_SHARD_FILES // _MB) * _MB
    return min(HUB_MAX_SHARD, max(HUB_MIN_SHARD, share))


def resolve_shard_size(options: PlanOptions, tensors: Mapping[str, TensorPlan]) -> PlanOptions:
    """``options`` with ``out_shard_size`` picked by :func:`hub_shard_size` when it is ``AUTO_SHARD_SIZE``."""
    if options.out_shard_size != AUTO_SHARD_SIZE:
        return options
    return replace(options, out_shard_size=hub_shard_size(tensors))


def default_shard_size(to_hub: bool) -> tuple[int | None, str]:
    """The output shard size when ``--out-shard-size`` is not given, and why (``plan`` shows it): None for an
    ``hf://`` OUT (``to_hub``), whose last shards' upload is the tail of the run: the planner picks it."""
    if to_hub:
        return None, (f"the default for an hf:// OUT: about 1/{HUB_SHARD_FILES} of the output, between "
                      f"{HUB_MIN_SHARD // _MB} MB and {HUB_MAX_SHARD / 1e9:g} GB, so the run ends one short upload "
                      "after the merge")
    return DEFAULT_SHARD_SIZE, "the default for a local OUT"


def shard_size_choice(asked: int | str | None, out: str | os.PathLike[str] | None
                      ) -> tuple[int | str | None, str | None]:
    """``--out-shard-size`` as ``asked``, else the default for ``out`` (None: no OUT, as for a local one; a size of
    None: the planner's pick, :data:`AUTO_SHARD_SIZE`), and why (None when asked)."""
    return (asked, None) if asked is not None else default_shard_size(out is not None and is_hub_target(out))


# A numbered shard of a parent's top folder: what comes before the numbers (no folder), the shard's number, the count.
_NUMBERED = re.compile(r"(?P<stem>[\w.-]*?)(?P<index>\d+)-of-(?P<total>\d+)\.safetensors")


@dataclass(frozen=True)
class ShardNaming:
    """How shard files are numbered: the text before the numbers and the zero-padded width of the shard's number
    and of the count (1: not padded). The default is transformers' (``save_pretrained``) and mergekit's."""

    stem: str = "model-"
    index_width: int = 5
    total_width: int = 5

    def names(self, count: int) -> list[str]:
        """Final file names for ``count`` shards: ``model.safetensors`` alone for one (as transformers names it)."""
        if count == 1:
            return ["model.safetensors"]
        return [f"{self.stem}{i + 1:0{self.index_width}d}-of-{count:0{self.total_width}d}.safetensors"
                for i in range(count)]


def parent_naming(files: Iterable[str]) -> ShardNaming:
    """The numbering of a checkpoint's weight ``files`` (names relative to its folder), read from its first shard
    (number 1): its number's digits give the width; the count's give its width when zero-padded, else none (Kimi-K2's
    ``model-1-of-61``). The default for a single file, ``.bin`` shards or names of another form."""
    for name in files:
        found = _NUMBERED.fullmatch(name)
        if found is not None and int(found["index"]) == 1:
            total = found["total"]
            return ShardNaming(found["stem"], len(found["index"]), len(total) if total.startswith("0") else 1)
    return ShardNaming()


def output_naming(options: PlanOptions, parent_files: Iterable[str]) -> tuple[PlanOptions, ShardNaming]:
    """The naming of a plan's output shards: like ``parent_files`` (the base or first model's weight files) when
    ``options.parent_shard_names``, else the default (a run recorded before outputs followed their parents); and
    ``options`` with ``parent_shard_names`` kept only when it changes a name, so the plan of a parent named the
    default way has the options (fingerprint, manifest) it had before the option existed."""
    naming = parent_naming(parent_files) if options.parent_shard_names else ShardNaming()
    if naming == ShardNaming():
        return replace(options, parent_shard_names=False), naming
    return options, naming


def shard_names(count: int) -> list[str]:
    """Final file names for ``count`` shards in the default naming."""
    return ShardNaming().names(count)


def assign_shards(
    tensors: Mapping[str, TensorPlan], cap: int, *, last: Collection[str] = (), naming: ShardNaming = ShardNaming()
) -> tuple[tuple[ShardPlan, ...], dict[str, TensorPlan]]:
    """Split ``tensors`` into shards of at most ``cap`` data bytes, named by ``naming``; returns the shards and
    tensors with ``shard`` set, by name.

    Each shard lists its tensors in on-disk data order (the safetensors layout; a tensor stored as several parts
    where its first part is), so the engine can write sequentially. The tensors named in ``last`` get the last
    shard(s) to themselves: the engine runs shards in order, so everything else is committed before it waits for
    them (MoE's routers, computed beside the merge). One pass over the names, sorted once.
    """
    names = sorted(tensors)
    late = set(last)
    groups: list[list[str]] = []
    for part in ([n for n in names if n not in late], [n for n in names if n in late] if late else []):
        size = 0
        if part:
            groups.append([])
        for name in part:
            nbytes = tensors[name].nbytes
            if groups[-1] and size + nbytes > cap:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
    groups = groups or [[]]
    shards = []
    placed: dict[str, TensorPlan] = {}
    for fname, group in zip(naming.names(len(groups)), groups):
        owner: dict[str, str] = {}
        parts: dict[str, tuple[str, tuple[int, ...]]] = {}
        for n in group:
            for p in tensors[n].stored_parts():
                owner[p.name] = n
                parts[p.name] = (p.dtype, p.shape)
        order, file_size = shard_extent(parts)  # as stored_layout lays them out
        shards.append(ShardPlan(fname, tuple(dict.fromkeys([owner[p] for p in order])), file_size))
        for n in group:
            placed[n] = tensors[n].in_shard(fname)
    return tuple(shards), placed if not late else {n: placed[n] for n in names}
