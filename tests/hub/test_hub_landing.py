"""Hub inputs downloaded while the merge runs (issue 27): the merge reads each byte once it has landed in the cache,
and publishes no output shard before every input file it read is checked against the hub's checksum."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import digests, linear_config, write_config

from hub.fakehub import FakeHub, files_of
from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.inputs.hub import HubUnavailableError
from resumerge.inputs.hub import download as download_module
from resumerge.inputs.hub import landing as landing_module
from resumerge.inputs.hub.landing import Downloads, Landing

# One weight file per model (so a hold on it holds the whole input), read in file order by small output shards.
SPEC = ModelSpec(layers=4, hidden=64, intermediate=96, vocab=128, shard_bytes=10**9)
A, B = "org/land-a", "org/land-b"
WEIGHTS = "model.safetensors"
SHARD = "100k"


def _weights(out: Path) -> dict[str, str]:
    """Digests of the shards, index and config.json (the card and YAML name the models as the config gave them)."""
    return {k: v for k, v in digests(out).items() if k.endswith((".safetensors", ".index.json", "config.json"))}


class _Seen:
    """A reporter that remembers which tensors were computed and which files were published, with an event for
    "this many tensors are done"."""

    def __init__(self, wanted: int) -> None:
        self.tensors: list[str] = []
        self.files: list[str] = []
        self.enough = threading.Event()
        self._wanted = wanted

    def start(self, **_: int) -> None: ...

    def tensor_done(self, name: str, nbytes: int) -> None:
        self.tensors.append(name)
        if len(self.tensors) >= self._wanted:
            self.enough.set()

    def file_done(self, name: str, kind: str) -> None:
        self.files.append(name)

    def message(self, text: str) -> None: ...

    def shard_started(self, name: str, nbytes: int, tensors: int) -> None: ...

    def memory_budget(self, nbytes: int) -> None: ...


@pytest.fixture
def pair(tmp_path_factory: pytest.TempPathFactory, hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("landing")
    models = {A: make_model(root / "a", SPEC, seed=5), B: make_model(root / "b", SPEC, seed=6)}
    for repo, directory in models.items():
        hub.push(repo, files_of(directory))
    # Downloads write what arrives chunk by chunk; the test's files are small, so make the chunks small too.
    monkeypatch.setattr(download_module, "DOWNLOAD_CHUNK", 16 * 1024)
    return models


def test_the_merge_reads_a_download_as_it_lands_and_publishes_nothing_unchecked(
        tmp_path: Path, hub: FakeHub, pair: dict[str, Path]) -> None:
    """While the last fifth of ``A``'s weights is held back by the hub, the first output shards are merged from
    the bytes that landed (today's engine downloaded every input before merging), but none is published: each
    waits until ``A``'s file has landed whole and matched its checksum. Released, the run ends equal to the merge
    of the local copies."""
    reference = tmp_path / "reference"
    local = write_config(tmp_path / "local.yml", linear_config(pair[A], pair[B]))
    api.run(local, reference, settings=api.Settings(state_dir=tmp_path / "ref-state",
                                                    output=api.Output(out_shard_size=SHARD)))
    first = api.plan_merge(local, settings=api.Settings(output=api.Output(out_shard_size=SHARD))).shards[0]
    size = (pair[A] / WEIGHTS).stat().st_size
    release = threading.Event()
    hub.hold_after[f"{A}/{WEIGHTS}"] = (size * 4 // 5, release)
    seen = _Seen(wanted=len(first.tensors))
    out = tmp_path / "out"
    config = write_config(tmp_path / "hub.yml", linear_config(Path(A), Path(B)))
    errors: list[BaseException] = []

    def merge() -> None:
        try:
            api.run(config, out, settings=api.Settings(state_dir=tmp_path / "state",
                                                       output=api.Output(out_shard_size=SHARD)), progress=seen)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=merge)
    worker.start()
    try:
        assert seen.enough.wait(20), f"the first shard was not merged while an input downloaded: {seen.tensors}"
        worker.join(0.5)  # time enough to publish it, were the writer not waiting for the check
        assert hub.served[f"{A}/{WEIGHTS}"] < size
        assert not [f for f in seen.files if f.endswith(".safetensors")], seen.files
        assert not list(out.glob("*.safetensors"))
    finally:
        release.set()
        worker.join(60)
    assert not errors, errors
    assert _weights(out) == _weights(reference)
    # The download went into the cache as always: a second run of the same inputs fetches no weight byte.
    hub.reset_counters()
    api.run(config, tmp_path / "again", settings=api.Settings(state_dir=tmp_path / "state2",
                                                              output=api.Output(out_shard_size=SHARD)))
    assert not {k: v for k, v in hub.file_bytes().items() if k.endswith(".safetensors")}
    assert _weights(tmp_path / "again") == _weights(reference)


def test_a_landing_read_before_a_failed_check_fails_instead_of_refetching(tmp_path: Path) -> None:
    """Bytes handed to the merge and then found not to be the hub's: the download is not silently fetched again
    (the merge would have used the bad bytes); the landing fails, and so does every later read and check."""
    path = tmp_path / "partial"
    landing = Landing("org/x@0123/model.safetensors", 8)
    with open(path, "a+b") as f:  # as the download opens its partial file
        landing.opened(f.fileno(), 0)
        f.write(b"abcdefgh")
        f.flush()
        landing.grew(8)
    assert bytes(landing.read(2, 5).numpy()) == b"cde"
    with pytest.raises(HubUnavailableError, match="fail the hub's checksum"):
        landing.before_retry()
    with pytest.raises(HubUnavailableError):
        landing.checked(0.01)
    landing.close()


def test_a_landing_read_waits_for_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "partial"
    landing = Landing("org/x@0123/model.safetensors", 8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    landing.opened(fd, 0)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(bytes(landing.read(4, 8).numpy())))
    reader.start()
    os.write(fd, b"abcd")
    landing.grew(4)
    reader.join(0.3)
    assert reader.is_alive() and not got  # the range ends past what landed
    os.write(fd, b"efgh")
    landing.grew(8)
    reader.join(5)
    assert got == [b"efgh"]
    assert not landing.checked(0.01)  # landed, not yet checked
    landing.finished(path)
    assert landing.checked(0.01)
    landing.close()
    os.close(fd)


class _Transfers:
    """Stands for ``land_file``: records which files start downloading, in order, and lands each one only once the
    test releases it (every byte at once), so the test decides what is in flight."""

    def __init__(self, root: Path, sizes: dict[str, int]) -> None:
        self.root, self.sizes = root, sizes
        self.started: list[str] = []
        self.release = {name: threading.Event() for name in sizes}
        self.began = {name: threading.Event() for name in sizes}

    def __call__(self, settings: object, repo: object, commit: str, remote: SimpleNamespace, records: object,
                 emit: object, landing: Landing, header: object = None) -> Path:
        self.started.append(remote.path)
        self.began[remote.path].set()
        path = self.root / remote.path
        path.write_bytes(bytes(range(256)) * (self.sizes[remote.path] // 256))
        with path.open("rb") as f:
            landing.opened(f.fileno(), 0)
        assert self.release[remote.path].wait(10)
        landing.grew(self.sizes[remote.path])
        landing.finished(path)
        return path


def _checked(landing: Landing) -> bool:
    """Whether ``landing`` is checked within 10 s (each wait may be woken by its bytes arriving first)."""
    return any(landing.checked(0.2) for _ in range(50))


def _one_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                sizes: dict[str, int]) -> tuple[_Transfers, Downloads]:
    """One worker's downloads of model ``m``'s files ``sizes``, each held by the stubbed transfer until released."""
    transfers = _Transfers(tmp_path, sizes)
    monkeypatch.setattr(landing_module, "land_file", transfers)
    meta = SimpleNamespace(repo_id="org/m", commit="c" * 40, settings=SimpleNamespace(cache_dir=tmp_path / "cache"),
                           files={name: SimpleNamespace(path=name, size=size) for name, size in sizes.items()},
                           headers={})
    downloads = Downloads([("m", meta, name) for name in sizes], records_dir=tmp_path / "records",  # type: ignore[misc]
                          workers=1)
    return transfers, downloads


def test_a_file_the_merge_waits_for_downloads_at_once_then_the_queue_narrows_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output shard that reads the end of one input file and the start of the next: the read of the next file,
    still queued behind the one downloading, starts its download at once (before, it waited for the first file's
    whole tail); once a download ends with more running than the workers, no queued file starts until one ends."""
    sizes = {"w1": 4096, "w2": 4096, "w3": 4096}
    transfers, downloads = _one_worker(tmp_path, monkeypatch, sizes)
    try:
        downloads.start([("m", "w1"), ("m", "w2"), ("m", "w3")])
        assert transfers.began["w1"].wait(10)
        read: list[bytes] = []
        reader = threading.Thread(target=lambda: read.append(bytes(downloads.landings["m", "w3"].read(0, 16).numpy())))
        reader.start()
        assert transfers.began["w3"].wait(10), transfers.started  # w1 still downloading: w3 did not wait for it
        assert transfers.started == ["w1", "w3"]
        transfers.release["w3"].set()
        reader.join(10)
        assert read == [bytes(range(16))]
        transfers.release["w1"].set()
        assert transfers.began["w2"].wait(10)  # one worker: w2 starts only once nothing else downloads
        transfers.release["w2"].set()
        assert _checked(downloads.landings["m", "w2"])
        assert downloads.started == [("m", "w1"), ("m", "w3"), ("m", "w2")]
    finally:
        for event in transfers.release.values():
            event.set()
        downloads.close()


def test_reads_of_a_file_already_downloading_start_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge reading the file being downloaded (the usual case) leaves the queue in plan order."""
    sizes = {"w1": 4096, "w2": 4096}
    transfers, downloads = _one_worker(tmp_path, monkeypatch, sizes)
    try:
        downloads.start([("m", "w1"), ("m", "w2")])
        assert transfers.began["w1"].wait(10)
        reader = threading.Thread(target=lambda: downloads.landings["m", "w1"].read(0, 16))
        reader.start()
        transfers.release["w1"].set()
        reader.join(10)
        transfers.release["w2"].set()
        assert _checked(downloads.landings["m", "w2"])
        assert transfers.started == ["w1", "w2"]
    finally:
        for event in transfers.release.values():
            event.set()
        downloads.close()
