"""One ``resumerge run CFG OUT --out-shard-size 1M`` in this process, its CPU by thread (issue 87 item 15): where a
tree's first run spends more than another's, the merge workers, the writer, the proof's threads or the main thread.

Usage::

    python -P bench/run_threads_cpu.py --tree T --config CFG --work DIR [--calls FILE]

Each thread's ``thread_time`` is taken as it ends, summed by name (``resumerge-merge_0`` and ``_1`` as one); the
main thread's at the end. Printed as one JSON line with the process's CPU (user + system). ``--calls FILE``: each
thread profiled by cProfile instead (slower: compare its counts, not its times), the Python calls per function by
thread name written to FILE as JSON (paths relative to the tree), to diff two trees' calls per tensor. Run trees
alternated (A B A B) in the same minutes; the figures count other sessions' load.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import resource
import shutil
import sys
import threading
import time
from typing import Any


def _name(thread: threading.Thread) -> str:
    head, _, tail = thread.name.partition(" ")[0].rpartition("_")
    return head if tail.isdigit() else thread.name.partition(" ")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", required=True, help="the resumerge tree to import")
    parser.add_argument("--config", required=True)
    parser.add_argument("--work", required=True, help="scratch folder (emptied): OUT and the state dir")
    parser.add_argument("--calls", help="profile each thread; write the call counts here")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    cpu: collections.Counter[str] = collections.Counter()
    profiles: list[tuple[str, cProfile.Profile]] = []
    lock = threading.Lock()
    inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap(self: threading.Thread) -> None:
        profile = cProfile.Profile() if args.calls else None
        if profile is not None:
            with lock:
                profiles.append((_name(self), profile))
            profile.enable()
        try:
            inner(self)
        finally:
            if profile is not None:
                profile.disable()
            with lock:
                cpu[_name(self)] += time.thread_time()

    threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    main_profile = cProfile.Profile() if args.calls else None
    if main_profile is not None:
        profiles.append(("main", main_profile))
        main_profile.enable()
    from resumerge.cli.commands import main as run

    code = run(["run", args.config, os.path.join(args.work, "out"), "--out-shard-size", "1M", "--quiet",
                "--state-dir", os.path.join(args.work, "state")])
    if main_profile is not None:
        main_profile.disable()
    cpu["main"] += time.thread_time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    if args.calls:
        calls: dict[str, dict[str, int]] = {}
        for name, profile in profiles:
            stats: Any = pstats.Stats(profile).stats  # type: ignore[attr-defined]
            into = calls.setdefault(name, {})
            for (path, _, function), (_, count, *_) in stats.items():
                key = f"{path.replace(args.tree.rstrip('/') + '/', '')}:{function}"
                into[key] = into.get(key, 0) + count
        with open(args.calls, "w") as out:
            json.dump(calls, out)
    print(json.dumps({"tree": args.tree, "code": code, "cpu": round(usage.ru_utime + usage.ru_stime, 2),
                      "threads": {k: round(v, 2) for k, v in sorted(cpu.items())}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
