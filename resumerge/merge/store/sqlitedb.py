"""sqlite-utils (:class:`Database`, :class:`Migrations`, :class:`NotFoundError`) as both ledgers import it:
without pandas.

sqlite-utils imports pandas whenever it is installed, only to map ``pandas.Timestamp`` values to TEXT columns, and
no ledger stores one. Importing pandas (and pyarrow under it) took about 0.5 s of every ``resumerge`` command that
opens a ledger (``status`` and every merge subprocess included) wherever pandas happens to be installed, as it is
beside mergekit or datasets, and about 70 MB of every run's resident memory (a process with torch grew from 219 to
289 MB). So sqlite-utils is first imported with pandas hidden (a ``None`` entry in
``sys.modules`` makes ``import pandas`` raise ImportError, which sqlite-utils expects); a process that already
imported pandas, or sqlite-utils, is left as it is. May import the standard library and sqlite-utils.
"""

from __future__ import annotations

import importlib
import sys


def _import_without_pandas() -> None:
    if "sqlite_utils.db" in sys.modules or "pandas" in sys.modules:
        return
    sys.modules["pandas"] = None  # type: ignore[assignment]
    try:
        importlib.import_module("sqlite_utils.db")
    finally:
        # Only our placeholder is removed: a real pandas imported meanwhile by another thread stays.
        if "pandas" in sys.modules and sys.modules["pandas"] is None:
            del sys.modules["pandas"]


_import_without_pandas()

from sqlite_utils import Database  # noqa: E402  (after the import above, which decides how sqlite-utils loads)
from sqlite_utils.db import NotFoundError  # noqa: E402
from sqlite_utils.migrations import Migrations  # noqa: E402

__all__ = ["Database", "Migrations", "NotFoundError"]
