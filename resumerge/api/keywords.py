"""The one spelling of every API call's options: one :class:`~resumerge.api.options.Settings` (``settings=``), as
:func:`~resumerge.api.calls.run` takes it, for ``status`` and ``check`` as for ``run``. A keyword that a call took
before (``state_dir=``, ``resources=``, ``executor=``, ``output=``, ``merging=``: the notebooks written then) is
refused with the spelling that replaced it (:class:`~resumerge.errors.UsageError`, exit 2), not with Python's bare
``TypeError``.

Imports nothing but ``errors``: ``status``'s module (:mod:`.reading`) takes it at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from resumerge.errors import UsageError

# The fields of Settings: a keyword of one of these names given beside (not inside) a call's settings.
SETTINGS_FIELDS = ("output", "merging", "resources", "hub", "stages", "state_dir", "executor")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_spelling(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` (a call that takes ``settings``), refusing a keyword named as a field of its settings with the
    spelling that replaced it."""
    code = function.__code__
    own = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    old = frozenset(f for f in SETTINGS_FIELDS if f not in own)
    name = function.__name__

    @functools.wraps(function)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        given = [k for k in kwargs if k in old]
        if given:
            inside = ", ".join(f"{k}=..." for k in given)
            raise UsageError(f"{name}() takes {' and '.join(given)} inside its settings now, as run() does",
                             hint=f"write {name}(..., settings=Settings({inside})): the one Settings object every "
                                  "call of resumerge.api takes")
        return function(*args, **kwargs)

    return call
