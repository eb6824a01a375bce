"""sqlite-utils' ``Database`` and ``Migrations``, imported without pandas.

sqlite-utils imports pandas at import time when it is installed, only to map pandas' types when rows hold them;
resumerge never stores pandas objects, and the import costs every run about 70 MB of resident memory (measured:
a process with torch grows from 219 to 289 MB). So pandas is hidden from that one import — and only from it: a
later ``import pandas`` (a notebook's) works as usual. Where pandas is already imported it is simply used.

May import: sqlite_utils.
"""

from __future__ import annotations

import sys

if "pandas" in sys.modules or "sqlite_utils.db" in sys.modules:
    from sqlite_utils import Database
    from sqlite_utils.migrations import Migrations
else:
    sys.modules["pandas"] = None  # type: ignore[assignment]  # makes sqlite-utils' optional import fail
    try:
        from sqlite_utils import Database
        from sqlite_utils.migrations import Migrations
    finally:
        if "pandas" in sys.modules and sys.modules["pandas"] is None:
            del sys.modules["pandas"]

__all__ = ["Database", "Migrations"]
