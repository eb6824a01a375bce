"""The huggingface_hub helpers resumerge uses, imported from their public home at run time.

``huggingface_hub.utils`` exports these lazily, which mypy cannot follow, so type checking reads them from the
modules that define them. ``http`` is the HTTP client package huggingface_hub itself uses (httpx in 1.x,
httpx2 in 2.x); ``huggingface_hub.utils.httpx`` keeps that name stable across versions.
"""

from typing import TYPE_CHECKING

from huggingface_hub import get_session, hf_raise_for_status

if TYPE_CHECKING:
    import httpx2 as http
    from huggingface_hub.utils._fixes import WeakFileLock
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils._validators import validate_repo_id
else:
    from huggingface_hub.utils import WeakFileLock, build_hf_headers, validate_repo_id
    from huggingface_hub.utils import httpx as http

__all__ = ["WeakFileLock", "build_hf_headers", "get_session", "hf_raise_for_status", "http", "validate_repo_id"]
