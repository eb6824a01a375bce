"""``--executor NAME`` and ``--ray-address``, as every command that takes an executor adds them: the names from the
API's one table (:data:`resumerge.api.options.EXECUTORS`), so a new executor is a choice of every command at once;
the command turns them into the executor object its API call takes (:func:`resumerge.api.options.executor_option`)."""

from __future__ import annotations

import argparse

# What a Ray node needs, said by every --executor help (the extra's install line, as the refusal without Ray says it).
RAY_NEEDS = "Ray on every node: pip install -c constraints.txt -e '.[ray]' in the clone"


def add_executor_flags(p: argparse.ArgumentParser, *, where: str, address: str) -> None:
    """``--executor`` (its choices the API's executor names, ``local`` the default; ``where``: what each runs, for
    the help) and ``--ray-address`` (``address``: what it joins the cluster for)."""
    from resumerge.api.options import EXECUTORS

    p.add_argument("--executor", choices=tuple(EXECUTORS), default="local",
                   help=f"{where} [default: local]")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help=f"with --executor ray: the cluster to join [default: $RAY_ADDRESS, else a Ray started for "
                        f"{address} on this machine]")
