"""One contract for every output sink: the memory sink (at once and batched), a local folder, a staged folder and a
hub repo on the stand-in hub; and the commit protocol's owner journaling through either kind of receipt."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hub.conftest import hf_env  # noqa: F401  (autouse: an isolated HF home, loopback only)
from hub.fakehub import FakeHub
from hub.fakehub_write import HubWriter

from resumerge.config.hubtarget import parse_hub_target
from resumerge.config.settings import Batching
from resumerge.merge.store.hubrepo import open_hub_repo
from resumerge.merge.store.hubsink import HubRepoSink
from resumerge.merge.store.journal_commit import CommitJournal
from resumerge.merge.store.manifest import MANIFEST_NAME, Manifest, ManifestBook, parse_manifest
from resumerge.merge.store.memsink import MemorySink
from resumerge.merge.store.sink import LocalDirSink, OutputSink, Receipt, StagedDirSink

# huggingface_hub's LFS PUT passes the file as ``data=``, which httpx deprecates (a warning in the client's own
# code; the suite turns warnings into errors): as for tests/hubout.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

KINDS = ("memory", "memory-batched", "local", "staged", "hub")
REPO = "alice/contract"
TOKEN = "hf_write_alice"


@dataclass
class Harness:
    """A sink, and how to see its output from outside it: what it holds, and a way to damage a file."""

    sink: OutputSink
    read: Callable[[], dict[str, bytes]]
    damage: Callable[[str, bytes], None]
    uploaded: Callable[[], None] = lambda: None  # wait until what was published is uploaded (a hub repo)


def _folder(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    kind = request.param
    out, staging = tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    staging.mkdir()
    if kind.startswith("memory"):
        memory = MemorySink(batched=kind == "memory-batched", scratch=staging)
        yield Harness(memory, lambda: dict(memory.files), memory.files.__setitem__)
    elif kind in ("local", "staged"):
        folder = LocalDirSink(out) if kind == "local" else StagedDirSink(out, staging)
        yield Harness(folder, lambda: _folder(out), lambda name, data: (out / name).write_bytes(data))
    else:
        fake = FakeHub()
        writer = HubWriter.attach(fake)
        writer.add_token(TOKEN, "alice")
        with fake:
            monkeypatch.setenv("HF_ENDPOINT", fake.url)
            monkeypatch.setenv("HF_TOKEN", TOKEN)
            repo = open_hub_repo(parse_hub_target(f"hf://{REPO}"))
            # Batches never come due by themselves: the contract's flush() is what commits.
            hub_sink = HubRepoSink(repo, staging, planned=["a.bin", "b.bin"], resume=f"resumerge resume hf://{REPO}",
                                   batching=Batching(every=1000, interval=3600.0))

            def read() -> dict[str, bytes]:
                return {k: v for k, v in writer.head_files(REPO).items() if k != ".gitattributes"}

            def damage(name: str, data: bytes) -> None:  # another writer's commit (the contract's last step)
                fake.push(REPO, {**writer.head_files(REPO), name: data})

            def uploaded() -> None:
                for entry in list(hub_sink.queue.state.entries):
                    assert entry.upload is not None
                    entry.upload.result(timeout=30)

            yield Harness(hub_sink, read, damage, uploaded)


def _publish(sink: OutputSink, name: str, data: bytes) -> Receipt:
    temp = sink.temp_for(name)
    assert not temp.exists()
    temp.write_bytes(data)
    return sink.publish(temp, name, hashlib.sha256(data).hexdigest())


def test_every_sink_commits_checks_lists_and_deletes_only_what_it_is_told(harness: Harness,
                                                                          tmp_path: Path) -> None:
    a, b, manifest = b"a" * 1000, b"b" * 3000, b'{"manifest": 1}\n'
    with harness.sink as sink:
        before = set(sink.names())
        receipts = [_publish(sink, "a.bin", a), _publish(sink, "b.bin", b)]
        assert [r.name for r in receipts] == ["a.bin", "b.bin"]
        sink.replace_small(MANIFEST_NAME, manifest)
        sink.flush()  # a sink that commits later commits now; one that committed at once has nothing waiting
        for receipt in receipts:
            assert receipt.done() and receipt.error() is None
            commit = receipt.commit()
            assert commit is None or isinstance(commit, str)
        assert len({r.commit() for r in receipts}) == 1  # one commit (or none with an id) holds both
        assert harness.read() == {"a.bin": a, "b.bin": b, MANIFEST_NAME: manifest}
        assert list(tmp_path.rglob("*.part")) == []  # no temp file left, wherever the sink put them
        assert set(sink.names()) - before == {"a.bin", "b.bin", MANIFEST_NAME}
        sha_a, sha_b = hashlib.sha256(a).hexdigest(), hashlib.sha256(b).hexdigest()
        problems = sink.check([("a.bin", len(a), sha_a), ("b.bin", len(b), sha_b), ("never.bin", 3, sha_a)])
        assert problems["a.bin"] is None and problems["b.bin"] is None and problems["never.bin"]
        assert sink.check([("a.bin", len(a), sha_b)])["a.bin"]  # the wrong checksum is never "intact"
        sink.delete(["a.bin", "never-written.bin"])
        assert "a.bin" not in sink.names() and "b.bin" in sink.names()
        assert sink.check([("a.bin", len(a), sha_a)])["a.bin"]
        harness.damage("b.bin", b"c" * len(b))  # behind the sink's back, same size
        assert sink.check([("b.bin", len(b), sha_b)])["b.bin"]


def test_a_stopping_sink_commits_what_it_holds_or_has_nothing_waiting(harness: Harness) -> None:
    with harness.sink as sink:
        receipt = _publish(sink, "a.bin", b"a" * 10)
        sink.replace_small(MANIFEST_NAME, b"{}\n")
        harness.uploaded()
        last = sink.stop()
        # Committed at once (nothing waits for the last commit), or waiting for it and covered by it.
        assert [r.name for r in last] == ([] if receipt.done() and not last else ["a.bin"])
        assert receipt.wait(30) and receipt.error() is None
        assert harness.read() == {"a.bin": b"a" * 10, MANIFEST_NAME: b"{}\n"}


class _Ledger:
    """The ledger's writing side as the journal uses it; each row notes what the output held when it was written."""

    def __init__(self, sink: MemorySink) -> None:
        self.sink, self.rows, self.events = sink, [], []  # type: ignore[var-annotated]

    def commit_file(self, name: str, **row: Any) -> None:
        listed = parse_manifest(self.sink.files[MANIFEST_NAME], "memory").committed
        self.rows.append((name, self.sink.files.get(name), name in listed))

    def event(self, kind: str, message: str, data: Any = None) -> None:
        self.events.append((kind, message))

    def records_checksum(self) -> None:
        return None  # nothing committed yet: the journal records with the sink's checksum


def _book(sink: MemorySink) -> ManifestBook:
    manifest = Manifest(version="0", fingerprint="f", parts={}, inputs={}, options={}, model_dirs={},
                        config_text="", planned=("a.bin", "config.json"))
    book = ManifestBook(sink, manifest)
    book.set_state("running")
    return book


@pytest.mark.parametrize("batched", [False, True])
def test_the_journal_records_a_file_only_once_its_commit_landed(batched: bool) -> None:
    with MemorySink(batched=batched) as sink:
        ledger = _Ledger(sink)
        journal = CommitJournal(sink, ledger, _book(sink))  # type: ignore[arg-type]
        journal.write_small("config.json", b"{}")
        assert ledger.rows == ([] if batched else [("config.json", b"{}", False)])  # at once: row, then manifest
        assert journal.finish() == []
        # The file was committed when its row was written; a batched sink committed the manifest listing it with it.
        assert ledger.rows == [("config.json", b"{}", batched)]
        assert parse_manifest(sink.files[MANIFEST_NAME], "memory").committed["config.json"]["bytes"] == 2
        assert [kind for kind, _ in ledger.events] == (["commit"] if batched else [])


def test_a_stopped_run_journals_the_last_commit_of_a_batched_sink() -> None:
    with MemorySink(batched=True) as sink:
        ledger = _Ledger(sink)
        journal = CommitJournal(sink, ledger, _book(sink))  # type: ignore[arg-type]
        journal.write_small("config.json", b"{}")
        assert ledger.rows == []
        assert journal.stop() == 1 and journal.stopped(5.0) is None
        assert ledger.rows == [("config.json", b"{}", True)]
    with MemorySink() as sink:
        journal = CommitJournal(sink, _Ledger(sink), _book(sink))  # type: ignore[arg-type]
        assert journal.stop() == 0 and journal.stopped(5.0) is None  # nothing ever waits: nothing to say
