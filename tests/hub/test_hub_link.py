"""The stand-in hub's simulated link paces itself, not the client: concurrent downloads and an upload reach both
rates at once and never run ahead of them by more than the bucket's burst (so a bench behind the link measures the
merge, not the harness)."""

from __future__ import annotations

import hashlib
import http.client
import os
import threading
import time
from urllib.parse import urlsplit

import pytest

from hub.fakehub import FakeHub
from hub.fakehub_link import BURST, CHUNK, Link, TokenBucket
from hub.fakehub_write import HubWriter

MB = 10**6
DOWN, UP = 16 * MB, 8 * MB  # modest rates: each direction moves its bytes in about a second
FILE = 8 * MB  # served to two concurrent readers: 16 MB down
PAYLOAD = 8 * MB  # one LFS PUT: 8 MB up


def _connection(hub: FakeHub) -> http.client.HTTPConnection:
    url = urlsplit(hub.url)
    return http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)


def _download(hub: FakeHub, path: str, headers: dict[str, str], done: dict[str, float], name: str) -> None:
    conn = _connection(hub)
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    got = 0
    while piece := response.read(CHUNK):
        got += len(piece)
    done[name] = time.monotonic()
    done[f"{name}-bytes"] = got
    conn.close()


def _upload(hub: FakeHub, repo: str, payload: bytes, done: dict[str, float]) -> None:
    oid = hashlib.sha256(payload).hexdigest()
    conn = _connection(hub)
    conn.request("PUT", f"/_lfs/{repo}/{oid}", body=payload, headers={"Content-Length": str(len(payload))})
    status = conn.getresponse().status  # answered once the server read the whole body through the link
    done["up"] = time.monotonic()
    done["up-status"] = status
    conn.close()


def _sample(link: Link, stop: threading.Event, samples: list[tuple[float, int, int]]) -> None:
    while not stop.is_set():
        down, up = link.down_bytes, link.up_bytes  # the counts first: each was reached before the time read
        samples.append((time.monotonic(), down, up))
        stop.wait(0.01)


def test_the_link_reaches_both_rates_at_once_and_never_exceeds_them() -> None:
    data = os.urandom(FILE)
    payload = os.urandom(PAYLOAD)
    hub = FakeHub(link=Link(down=DOWN, up=UP))
    writer = HubWriter.attach(hub)
    writer.create_repo("org/up")
    hub.push("org/data", {"model.safetensors": data})
    done: dict[str, float] = {}
    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()
    with hub:
        hub.link.reset()
        resolve = "/org/data/resolve/main/model.safetensors"
        ranged = {"Range": f"bytes=0-{FILE - 1}"}
        jobs = [threading.Thread(target=_download, args=(hub, resolve, {}, done, "whole")),
                threading.Thread(target=_download, args=(hub, resolve, ranged, done, "range")),
                threading.Thread(target=_upload, args=(hub, "org/up", payload, done))]
        sampler = threading.Thread(target=_sample, args=(hub.link, stop, samples))
        sampler.start()
        started = time.monotonic()
        for job in jobs:
            job.start()
        for job in jobs:
            job.join(timeout=60)
        stop.set()
        sampler.join()
    assert done["whole-bytes"] == done["range-bytes"] == FILE and done["up-status"] == 200
    down_rate = 2 * FILE / (max(done["whole"], done["range"]) - started)
    up_rate = PAYLOAD / (done["up"] - started)
    # Both directions at once, each near its own rate: the harness keeps up.
    assert down_rate >= 0.85 * DOWN, f"download {down_rate / MB:.1f} MB/s of {DOWN / MB:.0f}"
    assert up_rate >= 0.85 * UP, f"upload {up_rate / MB:.1f} MB/s of {UP / MB:.0f}"
    # And never above it: over every window between two samples, at most rate × window + the burst (plus one
    # chunk per concurrent request, granted before a sample and counted after it).
    slack = BURST + 2 * CHUNK
    for i, (t1, down1, up1) in enumerate(samples):
        for t2, down2, up2 in samples[i + 1 :]:
            assert down2 - down1 <= DOWN * (t2 - t1) + slack, f"{down2 - down1} B down in {t2 - t1:.3f} s"
            assert up2 - up1 <= UP * (t2 - t1) + slack, f"{up2 - up1} B up in {t2 - t1:.3f} s"
    # The counters: every body byte that crossed, and when the file's last byte went out.
    assert hub.link.down_bytes >= 2 * FILE and hub.link.up_bytes >= PAYLOAD
    assert started < hub.served_at["org/data/model.safetensors"] <= max(done["whole"], done["range"])
    assert writer.puts[f"org/up/{hashlib.sha256(payload).hexdigest()}"] == 1


def test_a_link_per_connection_gives_each_connection_the_rate() -> None:
    # Two clients with connections of their own (a cluster's nodes): each gets the rate, not half of it, and no
    # connection runs ahead of it; the bytes of both count on the hub's link.
    size = 4 * MB
    hub = FakeHub(link=Link(down=DOWN, per_connection=True))
    hub.push("org/data", {"model.safetensors": os.urandom(size)})
    done: dict[str, float] = {}
    with hub:
        hub.link.reset()
        resolve = "/org/data/resolve/main/model.safetensors"
        jobs = [threading.Thread(target=_download, args=(hub, resolve, {"Range": f"bytes=0-{size - 1}"}, done, n))
                for n in ("one", "two")]
        started = time.monotonic()
        for job in jobs:
            job.start()
        for job in jobs:
            job.join(timeout=60)
    took = max(done["one"], done["two"]) - started
    assert done["one-bytes"] == done["two-bytes"] == size
    assert took >= size / DOWN  # each connection paced at the rate, from its start (no burst saved)
    assert 2 * size / took >= 1.5 * DOWN, f"{2 * size / took / MB:.1f} MB/s in all: the connections shared a bucket"
    assert hub.link.down_bytes == 2 * size


def test_an_unlimited_link_counts_without_pacing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"an unlimited link slept {seconds} s")

    monkeypatch.setattr(time, "sleep", no_sleep)
    TokenBucket(None).take(10**12)  # a terabyte, at once
    hub = FakeHub()
    writer = HubWriter.attach(hub)
    writer.add_token("t", "org")
    writer.create_repo("org/up")
    hub.push("org/data", {"config.json": b"{}"})
    commit = (b'{"key": "header", "value": {"summary": "s"}}\n'
              b'{"key": "file", "value": {"path": "a.json", "content": "e30=", "encoding": "base64"}}\n')
    with hub:
        conn = _connection(hub)
        conn.request("GET", "/org/data/resolve/main/config.json")
        assert conn.getresponse().read() == b"{}"
        before = time.monotonic()
        conn.request("POST", "/api/models/org/up/commit/main", body=commit, headers={"Authorization": "Bearer t"})
        assert conn.getresponse().status == 200
        conn.close()
    assert writer.head_files("org/up")["a.json"] == b"{}"
    assert [repo for repo, _ in hub.commit_times] == ["org/up"] and hub.commit_times[0][1] >= before
    assert hub.link.up_bytes == len(commit) and hub.link.down_bytes >= 2  # the file, and the commit's answer
    with pytest.raises(ValueError, match="positive"):
        Link(down=0)


def test_a_large_upload_never_stalls_the_stand_ins_other_transfers() -> None:
    """Receiving a large body must not hold the stand-in's GIL for long: every download it serves meanwhile shares
    that GIL, and the simulated link idles while they wait. Reading a 100 MB body into a zeroed bytearray and
    copying it into bytes held it 0.2 s on a VM, which made the bench's stand-in carry 150/75 MB/s at only
    1.4x/1.6x the link floor even with near-free clients: the harness, not the client, was measured."""
    # Two bodies, made before the clock starts (making one holds this process's GIL as long as the old stand-in
    # did); the second lands in memory the first one's pages no longer hold.
    payloads = [os.urandom(MB) * 192, os.urandom(MB) * 192]
    hub = FakeHub()
    writer = HubWriter.attach(hub)
    writer.create_repo("org/up")
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:  # a thread of the stand-in's process, needing the GIL every millisecond
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    done: dict[str, float] = {}
    with hub:
        ticker = threading.Thread(target=tick)
        ticker.start()
        for payload in payloads:
            _upload(hub, "org/up", payload, done)
            assert done["up-status"] == 200
        stop.set()
        ticker.join()
    worst = sorted(gaps)[-3:]
    # The third-longest wait, so that a preemption or two by other processes on a busy CI machine does not count;
    # the old reading waited 0.11-0.16 s here three times per run, this one 0.01-0.03 s.
    assert worst[0] < 0.08, f"the stand-in's GIL was held {[round(g, 3) for g in worst]} s at a time"
