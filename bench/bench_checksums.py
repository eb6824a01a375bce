"""Throughput of the output files' checksums on one core (resumerge/machine/checksums.py): sha256 (a hub repo's
files, and every record before issue 87) and xxh3-128 (a folder's), each fed a buffer in the 8 MiB blocks
``hash_file`` reads, best of REPEATS, CPU seconds of this process (``time.process_time``: one thread).

    PYTHONPATH=$PWD python bench/bench_checksums.py [MIB [REPEATS]]

Default 1024 MiB of random bytes in memory (no disk read in the figure), REPEATS 3. Prints GB/s (10^9 bytes a
CPU second) per algorithm and the ratio; quote ``uptime`` beside it.
"""

from __future__ import annotations

import os
import sys
import time

from resumerge.machine.checksums import SHA256, XXH3_128, Checksum

BLOCK = 8 * 2**20


def rate(checksum: Checksum, data: memoryview, repeats: int) -> float:
    """GB a CPU second of ``checksum`` over ``data``, best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        hasher = checksum.new()
        for at in range(0, len(data), BLOCK):
            hasher.update(data[at:at + BLOCK])
        hasher.hexdigest()
        best = min(best, time.process_time() - start)
    return len(data) / best / 1e9


def main(argv: list[str]) -> None:
    mib = int(argv[0]) if argv else 1024
    repeats = int(argv[1]) if len(argv) > 1 else 3
    data = memoryview(os.urandom(mib * 2**20))
    sha, xxh = rate(SHA256, data, repeats), rate(XXH3_128, data, repeats)
    print(f"sha256 {sha:.2f} GB/s, xxh3-128 {xxh:.2f} GB/s a core ({xxh / sha:.0f}x), {mib} MiB, best of {repeats}; "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
