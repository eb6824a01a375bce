"""The per-installation cache of fresh processes' baselines (``baseline.json``) shared by every process of resumerge
on the machine: two runs starting together keep both their figures, a reader never sees part of a write, a file that
is not the cache's is never trusted, and a slow measuring child is not killed for the machine's load alone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resumerge.machine.memory import baseline

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock, /proc")

# A process keeping KEYS figures in the cache under argv[1] (each its own module list, its measurement stood in for
# by a number), once the file argv[2] exists: the processes started together keep theirs at the same time.
_WRITER = """import sys, time
from pathlib import Path
from resumerge.machine.memory import baseline
folder, go, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
baseline._measure = lambda modules: 1000 + len(modules[0])
while not go.exists():
    time.sleep(0.005)
for k in range({keys}):
    baseline.fresh_baseline((f"{{name}}-{{k}}",), folder)
    baseline.settled_reading((name, str(k)), 10_000 + k, folder)
"""
# A process reading the cache under argv[1] until argv[2] exists: each reading whole JSON, or no file yet.
_READER = """import json, sys
from pathlib import Path
path, done = Path(sys.argv[1]) / "baseline.json", Path(sys.argv[2])
reads = 0
while not done.exists():
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        continue
    json.loads(text)
    reads += 1
print(reads)
"""


@linux_only
def test_processes_keeping_figures_together_keep_every_one(tmp_path: Path) -> None:
    """Four processes each keep 20 fresh baselines and 20 settled readings in one cache at the same time: every
    figure is there after (before, each read-modify-write of the file dropped what another wrote between its read
    and its rename, and that baseline was measured again at a later start); a reader beside them always reads a
    whole file."""
    writers, keys = 4, 20
    go, done = tmp_path / "go", tmp_path / "done"
    folder = tmp_path / "cache"
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(folder), str(done)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    started = [subprocess.Popen([sys.executable, "-c", _WRITER.format(keys=keys), str(folder), str(go), f"w{i}"],
                                stderr=subprocess.PIPE, text=True) for i in range(writers)]
    try:
        time.sleep(0.5)  # each imported the module before the start
        go.touch()
        errors = [child.communicate(timeout=300)[1] for child in started]
    finally:
        done.touch()
        for child in started:
            child.kill()
    read, read_err = reader.communicate(timeout=60)
    assert all(child.returncode == 0 for child in started), errors
    assert reader.returncode == 0 and int(read) > 0, read_err  # no torn file read
    figures = json.loads((folder / "baseline.json").read_text(encoding="utf-8"))
    assert len(figures) == 2 * writers * keys, len(figures)
    assert sorted(figures.values()) == sorted([1000 + len(f"w0-{k}") for k in range(keys)] * writers
                                              + [10_000 + k + (10_000 + k) // 100 for k in range(keys)] * writers)


def test_a_file_that_is_not_the_cache_is_measured_again_never_trusted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache another program wrote, or an older resumerge, or a hand: a value that is no whole number of bytes
    (a bool, which Python counts an int: ``true`` was a baseline of 1 byte; a float, a string, a negative or zero
    figure) is measured again, and the file kept after holds only figures; a document that is no object, or JSON
    nested past the parser's depth, is a cache holding nothing."""
    monkeypatch.setattr(baseline, "_measure", lambda modules: 4242)
    key = baseline._key(("json",))
    path = tmp_path / "baseline.json"
    for foreign in (True, 1.5, "123", -5, 0, None, [7]):
        path.write_text(json.dumps({key: foreign, "other": {"a": 1}}))
        assert baseline.fresh_baseline(("json",), tmp_path) == 4242, foreign
        assert json.loads(path.read_text()) == {key: 4242}
    for document in ("[1, 2]", '"text"', "[" * 100_000 + "]" * 100_000, "\x00\xff"):
        path.write_text(document, encoding="latin-1")
        assert baseline.fresh_baseline(("json",), tmp_path) == 4242
    held = "held-" + key
    path.write_text(json.dumps({held: True}))
    assert baseline.settled_reading(("w",), 1000, tmp_path) == 1010  # the reading, not the file's "true"


@linux_only
def test_a_measuring_child_is_killed_when_it_stops_working_not_when_the_machine_is_slow(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A child (a measurement, or one compiling kernels ahead of them) that keeps using the CPU past the time a child
    is allowed without any (here 1 s) is waited for: on a loaded machine a compilation of a release's kernels ran
    past the 300 s of wall time a child had and was killed, its work done again by each measurement after it or its
    figure falling back to one without the kernels. One that uses none for that long (asleep, hung) is killed, as
    is one past the CPU ceiling."""
    monkeypatch.setattr(baseline, "_STALLED_SECONDS", 1.0)
    monkeypatch.setattr(baseline, "_POLL_SECONDS", 0.1)

    def child(code: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    busy = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end:\n    pass\nprint(123)\n"
    assert baseline._finish(child(busy)) == 123
    asleep = child("import time\ntime.sleep(60)\nprint(123)\n")
    assert baseline._finish(asleep) is None and asleep.returncode is not None
    monkeypatch.setattr(baseline, "_STALLED_SECONDS", 60.0)
    monkeypatch.setattr(baseline, "_CPU_CEILING", 0.5)
    spinning = child("while True:\n    pass\n")
    assert baseline._finish(spinning) is None and spinning.returncode is not None
