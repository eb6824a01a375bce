"""LoRA adapters given as Hugging Face Hub ids (the part after ``+`` in ``model+org/adapter@rev``).

An adapter repo goes through the same machinery as a hub model — the commit pinned once, files verified once
against the hub's checksums and the verification recorded, offline use from the cache — but it is small, so
it is fetched whole at once: its configs and tokenizer files, and ``adapter_model.safetensors``. No other
weight file of the repo is downloaded (a pickled ``adapter_model.bin`` never is).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError, ResumergeError
from resumerge.inputs.adapters import CONFIG_NAME, WEIGHTS_NAME, Adapter, open_adapter
from resumerge.inputs.files import InputFile
from resumerge.inputs.hub.events import ProgressCallback
from resumerge.inputs.hub.resolve import fetch_weights, resolve_metadata


def open_hub_adapter(
    ref: ModelRef,
    *,
    yaml_path: str,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    pinned_commit: str | None = None,
    records_dir: str | Path | None = None,
    on_progress: ProgressCallback | None = None,
) -> Adapter:
    """Resolve, fetch, verify and open the hub adapter ``ref.path@ref.revision``.

    ``pinned_commit`` (a resume passes the commit recorded in the adapter's snapshot directory) wins over the
    revision; the other arguments mean what they mean for :func:`resumerge.inputs.hub.resolve_metadata`. The returned
    adapter's ``directory`` is the cache snapshot of the pinned commit and its weights file's identity is the
    hub's sha256. Raises what ``resolve_metadata`` and ``fetch_weights`` raise (with ``yaml_path`` filled in),
    plus :class:`ModelInputError` for a repo without ``adapter_config.json`` or ``adapter_model.safetensors`` and
    everything :func:`~resumerge.inputs.adapters.open_adapter` refuses.
    """
    try:
        meta = resolve_metadata(ref, cache_dir=cache_dir, offline=offline, pinned_commit=pinned_commit,
                                records_dir=records_dir, on_progress=on_progress)
        where = f"{meta.repo_id}@{meta.commit[:12]}"
        if CONFIG_NAME not in meta.files:
            raise ModelInputError(
                f"{where} has no {CONFIG_NAME}, so it is not a PEFT adapter",
                hint="it looks like a full model: reference it without '+'" if "config.json" in meta.files else None,
            )
        if WEIGHTS_NAME not in meta.files:
            raise ModelInputError(f"{where} has no {WEIGHTS_NAME}",
                                  hint="only adapters saved as safetensors can be merged")
        fetch_weights(meta, [WEIGHTS_NAME], records_dir=records_dir, on_progress=on_progress)
    except ResumergeError as exc:
        exc.yaml_path = exc.yaml_path or yaml_path  # the hub layer knows the repo, the config knows where
        raise
    adapter = open_adapter(meta.snapshot_dir, yaml_path=yaml_path)
    remote = meta.files[WEIGHTS_NAME]
    # The hub's own checksum is the content identity: stronger than sampling, and already verified.
    identity = InputFile(WEIGHTS_NAME, adapter.files[0].size, remote.sha256 or remote.blob_id)
    return dataclasses.replace(adapter, files=(identity,))
