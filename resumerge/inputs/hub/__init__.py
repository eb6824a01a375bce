"""Hugging Face Hub inputs: resolve, validate, fetch and verify models in the normal huggingface_hub cache.

Call order for one hub model (``not is_local(ref)``):

1. :func:`resolve_metadata` — pins the commit, fetches config/tokenizer/index files, reads safetensors headers
   (HTTP Range when the weights are not cached); validate the merge from these;
2. :func:`fetch_weights` — checks free disk, downloads missing or damaged shards (resuming partial ones, and
   starting new ones from the header bytes phase one read: no byte fetched twice) and verifies every file against
   the hub's checksum, once; then holds each verified file's header to the one phase one read (:mod:`.headercheck`:
   the plan was made from it).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from resumerge.machine.torch_import import on_first_use

if TYPE_CHECKING:
    from resumerge.inputs.hub.cache import HubSettings, RemoteFile, hub_settings
    from resumerge.inputs.hub.events import HubEvent, ProgressCallback
    from resumerge.inputs.hub.local import is_local
    from resumerge.inputs.hub.remote import HubUnavailableError
    from resumerge.inputs.hub.resolve import RepoMetadata, fetch_weights, resolve_metadata

# Each name's module, imported on first use: a module of this package (the verify records a local run keeps, the
# counters of its reads) is imported without the others, so a run whose inputs and output are all local never
# imports huggingface_hub's client and its HTTP stack (httpx, httpcore, trio: about 0.3 s of CPU).
_WHERE = MappingProxyType({
    "HubSettings": ".cache", "RemoteFile": ".cache", "hub_settings": ".cache", "HubEvent": ".events",
    "ProgressCallback": ".events", "HubUnavailableError": ".remote", "RepoMetadata": ".resolve",
    "fetch_weights": ".resolve", "is_local": ".local", "resolve_metadata": ".resolve",
})

__all__ = [
    "HubEvent",
    "HubSettings",
    "HubUnavailableError",
    "ProgressCallback",
    "RemoteFile",
    "RepoMetadata",
    "fetch_weights",
    "hub_settings",
    "is_local",
    "resolve_metadata",
]


__getattr__ = on_first_use(__name__, _WHERE)
