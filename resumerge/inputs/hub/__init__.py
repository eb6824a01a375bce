"""Hugging Face Hub inputs: resolve, validate, fetch and verify models in the normal huggingface_hub cache.

Call order for one hub model (``not is_local(ref)``):

1. :func:`resolve_metadata` — pins the commit, fetches config/tokenizer/index files, reads safetensors headers
   (HTTP Range when the weights are not cached); validate the merge from these;
2. :func:`fetch_weights` — checks free disk, downloads missing or damaged shards (resuming partial ones, and
   starting new ones from the header bytes phase one read: no byte fetched twice) and verifies every file against
   the hub's checksum, once; then holds each verified file's header to the one phase one read (:mod:`.headercheck`:
   the plan was made from it).
"""

from resumerge.inputs.hub.cache import HubSettings, RemoteFile, hub_settings
from resumerge.inputs.hub.events import HubEvent, ProgressCallback
from resumerge.inputs.hub.remote import HubUnavailableError
from resumerge.inputs.hub.resolve import RepoMetadata, fetch_weights, is_local, resolve_metadata

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
