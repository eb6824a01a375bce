"""The command line's flat flags as the API's arguments: :func:`grouped` packs each flag into the option group
(:mod:`.options`) with a field of its name, :func:`options_of` lists what a function takes by flag name (what
tests/test_front_door.py holds equal to the CLI's flags), and :func:`executor_option` makes the executor object of
``--executor NAME`` from its row of the one table :data:`resumerge.config.passplace.EXECUTORS`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from resumerge.api.options import GROUPS, Settings
from resumerge.config import passplace
from resumerge.config.settings import KEEP_WORKERS
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.merge.engine.executors import Executor


def group_parameters(function: Callable[..., Any]) -> dict[str, type]:
    """The parameters of ``function`` that take a group, and the group each takes (read from its defaults; a
    ``settings`` whose default is None takes a :class:`Settings`: a call that imports no group before it is given
    one, ``status``)."""
    return {name: Settings if name == "settings" and p.default is None else type(p.default)
            for name, p in inspect.signature(function).parameters.items()
            if type(p.default) in GROUPS or (name == "settings" and p.default is None)}


def _honoured(group: type, function: str) -> Iterator[tuple[str, type | None]]:
    """The fields of ``group`` that ``function`` honours, each with the group it holds (None: an option)."""
    for each in fields(group):  # type: ignore[arg-type]
        if function not in each.metadata.get("not_for", ()):
            yield each.name, type(each.default) if type(each.default) in GROUPS else None


def _leaves(group: type, function: str) -> set[str]:
    """The options of ``group`` that ``function`` honours, those of the groups it holds included."""
    return {leaf for name, inner in _honoured(group, function)
            for leaf in ({name} if inner is None else _leaves(inner, function))}


def options_of(function: Callable[..., Any]) -> set[str]:
    """Every option ``function`` takes by name: its own parameters, and its groups' fields it honours, each named
    as the CLI's flag dest (what tests/test_front_door.py compares with the CLI's flags)."""
    groups = group_parameters(function)
    own = set(inspect.signature(function).parameters) - set(groups)
    return own | {leaf for group in groups.values() for leaf in _leaves(group, function.__name__)}


def _packed(group: type, function: str, flat: Mapping[str, Any]) -> Any:
    """``group`` of the options in ``flat`` it holds (None: it holds none of them)."""
    given: dict[str, Any] = {}
    for name, inner in _honoured(group, function):
        value = flat.get(name) if inner is None else _packed(inner, function, flat)
        if (name in flat) if inner is None else value is not None:
            given[name] = value
    return group(**given) if given else None


def grouped(function: Callable[..., Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` options (the CLI's parsed flags, by dest) as the keyword arguments of ``function``: each option
    that is a field of one of its groups goes into that group, the others are passed as they are."""
    groups = group_parameters(function)
    owned = {leaf for group in groups.values() for leaf in _leaves(group, function.__name__)}
    kwargs: dict[str, Any] = {k: v for k, v in flat.items() if k not in owned}
    for name, group in groups.items():
        value = _packed(group, function.__name__, flat)
        if value is not None:
            kwargs[name] = value
    return kwargs


# The command line's settings of an executor: each one's flag and the field of the executor's class it sets (a class
# without that field takes no such setting).
_SETTINGS = MappingProxyType({"--ray-address": "address", "--keep-workers": "keep_workers"})


def _fields(row: passplace.ExecutorRow) -> set[str]:
    """The fields of the class ``row`` makes (none for this process's own executor, which is not made)."""
    return set() if row.makes is None else set(inspect.signature(passplace.named(row.makes)).parameters)


def executor_option(executor: str, ray_address: str | None = None,
                    keep_workers: float | str | None = None) -> Executor | None:
    """The executor object of the command line's ``--executor NAME`` and its settings (``--ray-address``,
    ``--keep-workers``), made by its row of :data:`~resumerge.config.passplace.EXECUTORS`; None for ``local`` (the
    default). Raises UsageError for an unknown name and for a setting given to an executor that takes none."""
    row = passplace.EXECUTORS.get(executor)
    if row is None:
        raise UsageError(f"--executor must be one of {', '.join(passplace.EXECUTORS)}, not {executor!r}")
    given = {field: value for field, value in (("address", ray_address), ("keep_workers", keep_workers))
             if value is not None}
    for flag, field in _SETTINGS.items():
        if field in given and field not in _fields(row):
            takers = [name for name, other in passplace.EXECUTORS.items() if field in _fields(other)]
            raise UsageError(f"{flag} needs --executor {' or '.join(takers)}")
    if row.makes is None:  # this process: the merge engine is not imported (a local check's start)
        return None
    if "keep_workers" in given:
        given["keep_workers"] = keep_option(given["keep_workers"])
    made: Executor = passplace.named(row.makes)(**given)
    return made


def keep_option(keep: float | str | None) -> float:
    """The seconds of ``--keep-workers`` (a length with its unit, ``"10m"``; a number of seconds from the API; ``0``
    keeps none; None: the default, :data:`~resumerge.config.settings.KEEP_WORKERS`); raises UsageError (exit 2) for
    anything else, a bare number other than 0 in a string included (``--session`` reads one as hours: here it
    would be ambiguous)."""
    if keep is None:
        return KEEP_WORKERS
    if isinstance(keep, str):
        try:
            bare: float | None = float(keep)
        except ValueError:
            bare = None
        if bare == 0 or keep.strip() in ("0s", "0m", "0h"):
            return 0.0
        if bare is not None:
            raise UsageError(f"--keep-workers {keep.strip()}: give its unit", hint="e.g. --keep-workers 10m or 600s")
        from resumerge.analyses.estimate.sessions import parse_duration

        return parse_duration(keep, option="--keep-workers")
    if keep < 0:
        raise UsageError("--keep-workers must be at least 0")
    return float(keep)

