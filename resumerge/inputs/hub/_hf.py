"""The huggingface_hub helpers resumerge uses, imported from their public home at run time.

``huggingface_hub.utils`` exports these lazily, which mypy cannot follow, so type checking reads them from the
modules that define them. ``http`` is the HTTP client package huggingface_hub itself uses (httpx in 1.x,
httpx2 in 2.x), whose exceptions mean "network trouble". ``http_get_kwargs`` keeps only the keyword arguments
the installed ``http_get`` accepts (``tqdm_class`` and ``displayed_filename`` came late).
"""

import inspect
from typing import TYPE_CHECKING, Any

from huggingface_hub import get_session, hf_raise_for_status
from huggingface_hub.file_download import http_get

if TYPE_CHECKING:
    import httpx2 as http
    from huggingface_hub.utils._fixes import WeakFileLock
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils._validators import validate_repo_id
else:
    from huggingface_hub.utils import WeakFileLock, build_hf_headers, validate_repo_id

    try:
        import httpx2 as http
    except ImportError:  # huggingface_hub 1.x
        import httpx as http


def http_get_kwargs(**kwargs: Any) -> dict[str, Any]:
    """``kwargs`` minus those the installed ``huggingface_hub.file_download.http_get`` does not take."""
    accepted = inspect.signature(http_get).parameters
    return {name: value for name, value in kwargs.items() if name in accepted}


__all__ = [
    "WeakFileLock",
    "build_hf_headers",
    "get_session",
    "hf_raise_for_status",
    "http",
    "http_get",
    "http_get_kwargs",
    "validate_repo_id",
]
