"""``plan``'s network estimate (bytes each way at the link's rates, the pipelined wall and what bounds it) and the
progress display of both directions, fed by hand."""

from __future__ import annotations

import io
import os
from dataclasses import replace
from pathlib import Path

import pytest
from support import drain_pty

from resumerge.analyses.estimate import cpuprobe
from resumerge.analyses.estimate.cpuprobe import TransferCost, probe_transfer_cost
from resumerge.analyses.estimate.network import (
    COMPUTE,
    DOWNLOAD,
    GIVEN,
    MEASURED,
    UPLOAD,
    Bandwidth,
    NetworkEstimate,
    measure_download,
    parse_bandwidth,
)
from resumerge.cli.render import ProgressReporter
from resumerge.cli.trafficline import TrafficRates, traffic_line
from resumerge.errors import UsageError
from resumerge.merge.engine.traffic import Traffic, TrafficMeter

GB, MB = 10**9, 10**6
SHARE = 0.1 / 1.74  # the first of 100 MB shards of a 1.74 GB output


@pytest.mark.parametrize(("text", "down", "up"), [
    ("150MB/75MB", 150 * MB, 75 * MB),
    ("100MB", 100 * MB, 100 * MB),
    ("150MB/s/75MB/s", 150 * MB, 75 * MB),
    ("1GiB/10M", 2**30, 10 * MB),
])
def test_bandwidth_is_down_then_up(text: str, down: int, up: int) -> None:
    assert parse_bandwidth(text) == Bandwidth(down, up, GIVEN)


@pytest.mark.parametrize("text", ["fast", "0/1MB", "1MB/0", "1MB/2MB/3MB", "", "/", "-5MB"])
def test_a_bad_bandwidth_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="bandwidth") as bad:  # the API's keyword in str(), the flag for the CLI
        parse_bandwidth(text)
    assert "--bandwidth" in bad.value.one_line()


def _net(down: float | None, up: float | None, local: float | None, *, up_bytes: int = int(1.74 * GB),
         source: str = GIVEN) -> NetworkEstimate:
    return NetworkEstimate(int(3.48 * GB), up_bytes, Bandwidth(down, up, source), local, first_share=SHARE,
                           tail_bytes=100 * MB)


def test_upload_bound_hub_to_hub() -> None:
    net = _net(200 * MB, 75 * MB, 10.0)
    assert net.down_seconds == pytest.approx(17.4) and net.up_seconds == pytest.approx(23.2)
    # The upload starts after the first shard (its share of the 17.4 s ahead of it) and then runs flat out.
    assert net.seconds == pytest.approx(SHARE * 17.4 + 23.2) and net.bound == UPLOAD
    assert net.line() == ("about 24 s pipelined, upload-bound: download 3.48 GB at 200 MB/s (--bandwidth) = 17 s; "
                          "upload 1.74 GB at 75.0 MB/s (--bandwidth) = 23 s; local merge about 10 s")


def test_download_bound_ends_with_the_last_shards_upload() -> None:
    net = _net(100 * MB, 200 * MB, 10.0)
    assert net.seconds == pytest.approx(34.8 + 0.5) and net.bound == DOWNLOAD


def test_compute_bound_when_the_merge_is_slower_than_the_link() -> None:
    net = _net(100 * MB, 200 * MB, 60.0)
    assert net.seconds == pytest.approx(60.5) and net.bound == COMPUTE
    assert net.line().startswith("about 60 s pipelined, compute-bound: ")


def test_start_up_comes_first_and_the_transfers_cpu_shares_the_cores() -> None:
    """On 2 cores, 20 CPU seconds of receiving, hashing and copying add 10 s to a 10 s merge: with start-up, the
    local side (3 + 20 s) outlasts a 17.4 s download and bounds the run."""
    net = replace(_net(200 * MB, 150 * MB, 10.0), startup_seconds=3.0, transfer_cpu_seconds=20.0, cores=2)
    assert net.work_seconds == pytest.approx(20.0) and net.bound == COMPUTE
    assert net.seconds == pytest.approx(3.0 + 20.0 + 100 / 150)
    assert net.line().endswith("local merge about 10 s, the transfers' CPU about 20 s on 2 core(s), start-up 3.0 s")
    doc = net.to_json()
    assert (doc["startup_seconds"], doc["transfer_cpu_seconds"], doc["cores"]) == (3.0, 20.0, 2)


def test_torchs_import_overlaps_the_first_bytes_but_delays_the_merge_and_the_first_upload() -> None:
    """torch is imported once the downloads started: not part of the start-up before the first byte, but the merge
    starts after it (2 + 10 s of work against a 17.4 s download) and so does the first upload (2 s, later than the
    first shard's share of the 17.4 s ahead of it): 0.8 + max(17.4 + 0.67, 2 + 11.6)."""
    net = replace(_net(200 * MB, 150 * MB, 10.0), startup_seconds=0.8, import_seconds=2.0)
    assert SHARE * 17.4 < 2.0
    assert net.seconds == pytest.approx(0.8 + max(17.4 + 100 / 150, 2.0 + 1.74 * GB / (150 * MB)))
    assert net.bound == DOWNLOAD
    slow = replace(net, local_seconds=16.0)  # 2 + 16 s of work outlasts the download: the merge bounds the run
    assert slow.bound == COMPUTE and slow.seconds == pytest.approx(0.8 + 18.0 + 100 / 150)
    upload = replace(net, link=Bandwidth(200 * MB, 75 * MB, GIVEN))  # the upload starts at the import, not earlier
    assert upload.bound == UPLOAD and upload.seconds == pytest.approx(0.8 + 2.0 + 23.2)
    assert net.line().endswith("start-up 0.8 s, torch's import 2.0 s beside the first bytes")
    assert net.to_json()["import_seconds"] == 2.0


def test_the_transfer_probe_costs_a_downloaded_byte_more_than_nothing(tmp_path: Path) -> None:
    cost = probe_transfer_cost(tmp_path, 2 * 2**20)
    assert cost is not None and cost.down > 0 and cost.up > 0
    assert cost.seconds(2, 1) == pytest.approx(2 * cost.down + cost.up)
    assert not list(tmp_path.iterdir())  # its temp file is gone
    assert probe_transfer_cost(tmp_path / "missing", 2 * 2**20) is None


def test_the_transfer_probe_takes_the_median_of_its_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first round inflated by the kernel's state (measured 3.4 times the next ones after another process loaded
    3.5 GB) does not decide the estimate."""
    rounds = iter([TransferCost(33e-9, 20e-9), TransferCost(9e-9, 7e-9), TransferCost(8e-9, 8e-9)])
    monkeypatch.setattr(cpuprobe, "_one_round", lambda directory, data: next(rounds))
    cost = probe_transfer_cost(tmp_path, 2 * 2**20)
    assert cost == TransferCost(9e-9, 8e-9)
    monkeypatch.setattr(cpuprobe, "_one_round", lambda directory, data: None)
    assert probe_transfer_cost(tmp_path, 2 * 2**20) is None


def test_a_local_out_only_downloads() -> None:
    net = _net(150 * MB, None, 5.0, up_bytes=0, source=MEASURED)
    assert net.up_seconds == 0.0 and net.seconds == pytest.approx(23.2) and net.bound == DOWNLOAD
    assert "(measured)" in net.line() and "upload" not in net.line()


def test_an_unknown_upload_rate_leaves_the_wall_unknown() -> None:
    net = _net(150 * MB, None, 5.0, source=MEASURED)
    assert net.seconds is None and net.bound is None
    assert net.line().endswith("unknown link: pass --bandwidth DOWN/UP (e.g. 150MB/75MB)")
    assert "upload 1.74 GB at an unknown rate" in net.line()
    doc = net.to_json()
    assert (doc["seconds"], doc["bound"], doc["up_bytes_per_s"], doc["down_seconds"]) == (None, None, None, 23.2)


def test_the_download_rate_is_measured_net_of_the_latency() -> None:
    now = [0.0]
    reads: list[tuple[int, int]] = []

    def read(start: int, end: int) -> bytes:
        reads.append((start, end))
        now[0] += 0.05 + (end - start) / (100 * MB)  # 50 ms to the first byte, then 100 MB/s
        return b""

    size = 50 * MB
    assert measure_download(read, size, clock=lambda: now[0]) == pytest.approx(100 * MB)
    assert reads[0][0] == 0 and reads[1][1] == size  # the latency read, then the end of the file
    assert measure_download(read, 100_000, clock=lambda: now[0]) is None  # too small to tell

    def broken(start: int, end: int) -> bytes:
        raise OSError("connection refused")

    assert measure_download(broken, size) is None


def test_the_meter_adds_downloads_and_streams_and_reads_the_uploads() -> None:
    meter = TrafficMeter()
    assert not meter.snapshot().active
    streamed = [0]
    meter.watch_fetch(lambda: streamed[0])
    meter.watch_uploads(lambda: (30, 20))
    meter.expect(fetch=1000, commit=500)
    meter.file_progress("org/a/model.safetensors", 100)
    meter.file_progress("org/a/model.safetensors", 300)  # cumulative per file
    meter.file_progress("org/b/model.safetensors", 50)
    streamed[0] = 7
    assert meter.snapshot() == Traffic(fetched=357, to_fetch=1000, uploaded=30, committed=20, to_commit=500)


def test_rates_come_from_a_sliding_window() -> None:
    rates = TrafficRates(window=5.0)
    assert rates.add(0.0, Traffic(fetched=0, uploaded=0)) == (None, None)
    assert rates.add(2.0, Traffic(fetched=20 * MB, uploaded=10 * MB)) == (10 * MB, 5 * MB)
    for second in range(3, 11):  # then the link slows down to 1 MB/s down, nothing up
        rates.add(float(second), Traffic(fetched=20 * MB + (second - 2) * MB, uploaded=10 * MB))
    down, up = rates.add(11.0, Traffic(fetched=29 * MB, uploaded=10 * MB))
    assert down == pytest.approx(1 * MB) and up == 0.0  # the old, faster samples have left the window


def test_the_network_line_says_both_directions_and_the_eta() -> None:
    now = Traffic(fetched=40 * MB, to_fetch=100 * MB, uploaded=30 * MB, committed=20 * MB, to_commit=50 * MB)
    assert traffic_line(now, 10 * MB, 5 * MB) == ("network: down 10.0 MB/s, 40.0 MB of 100 MB fetched; up 5.00 MB/s, "
                                                  "20.0 MB of 50.0 MB committed; about 6 s left")
    assert traffic_line(now, None, None) == ("network: down 40.0 MB of 100 MB fetched; up 20.0 MB of 50.0 MB "
                                             "committed")  # no rate yet, no ETA
    assert traffic_line(Traffic(), 0.0, 0.0) is None  # a run off the network shows nothing
    local_out = Traffic(fetched=100 * MB, to_fetch=100 * MB)
    assert traffic_line(local_out, 10 * MB, None) == "network: down 10.0 MB/s, 100 MB of 100 MB fetched"


def test_plain_progress_carries_the_network_line() -> None:
    clock = [0.0]
    meter = TrafficMeter(to_fetch=100 * MB, to_commit=50 * MB)
    fetched = [0]
    meter.watch_fetch(lambda: fetched[0])
    meter.watch_uploads(lambda: (fetched[0] // 4, fetched[0] // 8))
    stream = io.StringIO()
    reporter = ProgressReporter(stream=stream, mode="plain", interval=10.0, rss=lambda: 1 * GB,
                                clock=lambda: clock[0], width=120)
    reporter.start(total_tensors=4, done_tensors=0, total_bytes=50 * MB, done_bytes=0)
    reporter.traffic(meter.snapshot)
    for step in range(1, 5):
        clock[0] += 5.0
        fetched[0] = step * 20 * MB
        reporter.tensor_done(f"t{step}", 10 * MB)
    reporter.close()
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("progress:")]
    assert lines, stream.getvalue()
    # 20 MB down and 5 MB uploaded every 5 s: 4 MB/s and 1 MB/s over the window.
    assert "network: down 4.00 MB/s, 80.0 MB of 100 MB fetched; up 1.00 MB/s, 10.0 MB of 50.0 MB committed" in (
        lines[-1]), lines[-1]


def test_live_progress_draws_the_network_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    meter = TrafficMeter(to_fetch=100 * MB, to_commit=50 * MB)
    meter.file_progress("org/a/model.safetensors", 60 * MB)
    meter.watch_uploads(lambda: (30 * MB, 20 * MB))
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        reporter = ProgressReporter(stream=tty, mode="live", rss=lambda: 1 * GB, width=120)
        reporter.start(total_tensors=1, done_tensors=0, total_bytes=50 * MB, done_bytes=0)
        reporter.traffic(meter.snapshot)
        reporter.tensor_done("t", 50 * MB)
        reporter.close()
    text = drain_pty(master)
    assert "network: down" in text and "60.0 MB of 100 MB fetched" in text and "20.0 MB of 50.0 MB committed" in text
