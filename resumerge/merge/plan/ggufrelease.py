"""A GGUF release in the plan (``--gguf-type q8_0,q6_k,q4_k_m``): one file per type, each laid out exactly as a run
of that type alone lays out its ``model.gguf`` (:func:`~resumerge.merge.plan.ggufout.gguf_output`: its header, its
tensors' types, offsets and units), under the name publishers give it (``NAME-Q4_K_M.gguf``).

The files share their tensors: each output tensor is one :class:`~resumerge.merge.plan.merge_plan.TensorPlan` whose
codec (:class:`~resumerge.outputs.gguf.releasecodec.ReleaseCodec`) encodes the one merged value into every file's
parts, each as that file's single-type plan encodes it. The first file leads: the engine computes its tensors once
and writes each file's parts into that file (:meth:`~resumerge.outputs.containers.OutputContainer.lead`); each file
keeps its own units, journaled on their own, so each resumes on its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs import TensorEncoder
from resumerge.inputs.safetensors_format import numel
from resumerge.merge.plan.merge_plan import ShardPlan, TensorPlan
from resumerge.outputs.containers import GgufFile, GgufRelease
from resumerge.outputs.gguf.hfvocab import built_once
from resumerge.outputs.gguf.releasecodec import ReleaseCodec

# One file's layout as a run of its type alone makes it: its shards, its tensors, its headers by file name.
Single = tuple[tuple[ShardPlan, ...], dict[str, TensorPlan], dict[str, bytes]]


def file_stem(name: str | None) -> str:
    """The stem of a release's file names: the output's model name (the config's ``name:``, a transplant's GGUF
    name) as a file name keeps it (runs of other characters as one ``-``), else ``model``."""
    stem = re.sub(r"[^A-Za-z0-9._+-]+", "-", name or "").strip("-.")
    return stem or "model"


def release_output(release: GgufRelease, name: str | None, single: Callable[[GgufFile], Single]
                   ) -> tuple[tuple[ShardPlan, ...], dict[str, TensorPlan], GgufRelease]:
    """The files of ``release`` for an output named ``name`` (:func:`file_stem`), each laid out as ``single``
    lays out a file of its type alone, their tensors shared, with the release as the plan carries it. Raises
    :class:`ModelInputError` for a type whose file would be split (``--gguf-split-max-size``: the API refuses it
    first) or would order its tensors otherwise (never for the types written today)."""
    release = replace(release, stem=file_stem(name))
    files = release.file_names()
    with built_once():  # one tokenizer's keys for every file
        singles = [single(GgufFile(kind, None, release.choices)) for kind in release.gguf_types]
    first, lead = singles[0][0][0], singles[0][1]
    shards, headers, facts = [], {}, []
    weights = sum(numel(tp.shape) for tp in lead.values())
    for file, kind, (laid, _, header) in zip(files, release.gguf_types, singles, strict=True):
        if len(laid) != 1 or laid[0].tensors != first.tensors:
            raise ModelInputError(f"--gguf-type {release.gguf_type}: the {kind} file is laid out otherwise than the "
                                  "first (split, or its tensors in another order)", hint="run that type alone")
        (head,) = header.values()
        shards.append(ShardPlan(file, laid[0].tensors, laid[0].file_size, laid[0].units))
        headers[file] = head
        facts.append((file, kind, laid[0].file_size, 8 * (laid[0].file_size - len(head)) / max(1, weights)))
    placed: dict[str, TensorPlan] = {
        n: replace(tp, out_codec=ReleaseCodec(files, tuple(_codecs(singles, n))), shard=files[0]).sized()
        for n, tp in lead.items()}
    return tuple(shards), placed, replace(release, headers=headers, facts=tuple(facts))


def _codecs(singles: list[Single], name: str) -> list[TensorEncoder]:
    """Each file's codec of output tensor ``name``."""
    return [placed[name].out_codec for _, placed, _ in singles]
