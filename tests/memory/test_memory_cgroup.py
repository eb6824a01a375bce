"""cgroup v1/v2 parsing from fixture trees: limits on ancestors, "max", hybrid hosts, missing files."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from support import write_files

from resumerge.machine.memory import SystemProbe, read_snapshot
from resumerge.machine.memory.cgroup import (
    inactive_file,
    locate,
    memory_limit,
    memory_usage,
    oom_kill_count,
    parse_proc_cgroup,
    working_set,
)

GiB = 2**30
MiB = 2**20
V1_UNLIMITED = "9223372036854771712\n"
V2_MOUNTINFO = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTINFO = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"


def _limit(root: Path) -> int | None:
    """The memory limit of the cgroup found under ``root`` (one must be found)."""
    found = locate(root)
    assert found is not None
    return memory_limit(found)


def make_tree(root: Path, proc_cgroup: str, files: dict[str, str], mountinfo: str | None = None) -> Path:
    """Write /proc/self/cgroup, optionally /proc/self/mountinfo, and ``files`` (paths relative to root)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    if mountinfo is not None:
        (root / "proc/self/mountinfo").write_text(mountinfo)
    write_files(root, files)
    return root


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0::/user.slice/app.scope\n", ("/user.slice/app.scope", None)),
        ("4:memory:/docker/abc\n1:cpu:/\n", (None, "/docker/abc")),
        ("7:cpu,memory:/x\n", (None, "/x")),
        ("9:name=systemd:/\n4:memory:/m\n0::/\n", ("/", "/m")),
        ("garbage\n\n3:cpuset:/\n", (None, None)),
        ("", (None, None)),
    ],
)
def test_parse_proc_cgroup(text: str, expected: tuple[str | None, str | None]) -> None:
    assert parse_proc_cgroup(text) == expected


def test_v2_limit_usage_working_set_and_oom_kills(tmp_path: Path) -> None:
    group = "sys/fs/cgroup/user.slice/app"
    make_tree(
        tmp_path,
        "0::/user.slice/app\n",
        {
            f"{group}/memory.max": f"{GiB}\n",
            f"{group}/memory.current": f"{600 * MiB}\n",
            f"{group}/memory.stat": f"anon {300 * MiB}\nfile {300 * MiB}\ninactive_file {100 * MiB}\n",
            f"{group}/memory.events": "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n",
            "sys/fs/cgroup/user.slice/memory.max": "max\n",
        },
        V2_MOUNTINFO,
    )
    found = locate(tmp_path)
    assert found is not None
    assert found.version == 2
    assert found.directory == tmp_path / group
    assert memory_limit(found) == GiB
    assert memory_usage(found) == 600 * MiB
    assert inactive_file(found) == 100 * MiB
    assert working_set(found) == 500 * MiB
    assert oom_kill_count(found) == 2
    snapshot = read_snapshot(tmp_path)
    assert snapshot is not None
    assert (snapshot.version, snapshot.limit, snapshot.working_set, snapshot.oom_kills) == (2, GiB, 500 * MiB, 2)


def test_v2_max_everywhere_means_no_limit(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        "0::/a/b\n",
        {
            "sys/fs/cgroup/a/b/memory.max": "max\n",
            "sys/fs/cgroup/a/b/memory.high": "max\n",
            "sys/fs/cgroup/a/memory.max": "max\n",
        },
    )
    assert _limit(tmp_path) is None


def test_v2_tighter_limit_on_an_ancestor_wins(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
            "sys/fs/cgroup/kubepods/pod1/memory.max": f"{512 * MiB}\n",
            "sys/fs/cgroup/kubepods/memory.max": f"{2 * GiB}\n",
        },
        V2_MOUNTINFO,
    )
    assert _limit(tmp_path) == 512 * MiB


def test_v2_memory_high_counts_as_a_limit(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        "0::/app\n",
        {"sys/fs/cgroup/app/memory.max": f"{2 * GiB}\n", "sys/fs/cgroup/app/memory.high": f"{GiB}\n"},
    )
    assert _limit(tmp_path) == GiB


def test_v1_unlimited_huge_value_and_ancestor_limit(tmp_path: Path) -> None:
    base = "sys/fs/cgroup/memory"
    make_tree(
        tmp_path,
        "12:pids:/\n4:memory:/docker/abc\n",
        {
            f"{base}/docker/abc/memory.limit_in_bytes": V1_UNLIMITED,
            f"{base}/docker/abc/memory.usage_in_bytes": f"{700 * MiB}\n",
            f"{base}/docker/abc/memory.stat": (
                f"inactive_file {10 * MiB}\ntotal_inactive_file {200 * MiB}\nhierarchical_memory_limit {V1_UNLIMITED}"
            ),
            f"{base}/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
            f"{base}/docker/memory.limit_in_bytes": f"{3 * GiB}\n",
            f"{base}/memory.limit_in_bytes": V1_UNLIMITED,
        },
        V1_MOUNTINFO,
    )
    found = locate(tmp_path)
    assert found is not None
    assert found.version == 1
    assert memory_limit(found) == 3 * GiB
    assert inactive_file(found) == 200 * MiB  # total_ (hierarchical) preferred
    assert working_set(found) == 500 * MiB
    assert oom_kill_count(found) == 1


def test_v1_only_unlimited_is_none(tmp_path: Path) -> None:
    make_tree(tmp_path, "4:memory:/x\n", {"sys/fs/cgroup/memory/x/memory.limit_in_bytes": V1_UNLIMITED})
    assert _limit(tmp_path) is None


def test_v1_hierarchical_limit_covers_ancestors_we_cannot_see(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        "7:cpu,memory:/\n",
        {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/memory.stat": f"hierarchical_memory_limit {GiB}\n",
        },
    )
    assert _limit(tmp_path) == GiB


def test_hybrid_host_uses_the_v1_memory_controller(tmp_path: Path) -> None:
    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    make_tree(
        tmp_path,
        "4:memory:/job/1\n0::/\n",
        {
            "sys/fs/cgroup/memory/job/1/memory.limit_in_bytes": f"{GiB}\n",
            "sys/fs/cgroup/unified/cgroup.procs": "1\n",
        },
        mountinfo,
    )
    found = locate(tmp_path)
    assert found is not None
    assert (found.version, memory_limit(found)) == (1, GiB)


def test_mount_root_prefix_is_stripped_without_a_cgroup_namespace(tmp_path: Path) -> None:
    # Docker without cgroupns: /proc/self/cgroup names /docker/abc but the mount shows only that subtree.
    mountinfo = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    make_tree(
        tmp_path,
        "4:memory:/docker/abc\n",
        {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GiB}\n"},
        mountinfo,
    )
    found = locate(tmp_path)
    assert found is not None
    assert found.directory == tmp_path / "sys/fs/cgroup/memory"
    assert memory_limit(found) == GiB


@pytest.mark.parametrize("path", ["/../../..", "/not/visible/here"])
def test_invisible_group_falls_back_to_the_mount(tmp_path: Path, path: str) -> None:
    make_tree(tmp_path, f"0::{path}\n", {"sys/fs/cgroup/memory.max": f"{GiB}\n"}, V2_MOUNTINFO)
    found = locate(tmp_path)
    assert found is not None
    assert found.directory == tmp_path / "sys/fs/cgroup"
    assert memory_limit(found) == GiB


def test_custom_mount_point_with_escaped_space(tmp_path: Path) -> None:
    mountinfo = r"50 23 0:40 / /mnt/my\040cgroups rw - cgroup2 none rw" + "\n"
    make_tree(tmp_path, "0::/g\n", {"mnt/my cgroups/g/memory.max": f"{GiB}\n"}, mountinfo)
    assert _limit(tmp_path) == GiB


def test_missing_and_malformed_files_mean_unknown(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        "0::/g\n",
        {"sys/fs/cgroup/g/memory.max": "lots\n", "sys/fs/cgroup/g/memory.stat": "inactive_file many\nx\n"},
    )
    found = locate(tmp_path)
    assert found is not None
    assert memory_limit(found) is None
    assert memory_usage(found) is None
    assert inactive_file(found) is None
    assert working_set(found) is None
    assert oom_kill_count(found) is None


def test_no_proc_or_no_cgroupfs_means_no_group(tmp_path: Path) -> None:
    assert locate(tmp_path) is None
    assert read_snapshot(tmp_path) is None
    make_tree(tmp_path, "0::/g\n", {})  # /proc says v2, but nothing is mounted
    assert locate(tmp_path) is None


def test_system_probe_caps_host_memory_at_the_container_headroom(tmp_path: Path) -> None:
    group = "sys/fs/cgroup/app"
    make_tree(
        tmp_path,
        "0::/app\n",
        {
            f"{group}/memory.max": f"{GiB}\n",
            f"{group}/memory.current": f"{600 * MiB}\n",
            f"{group}/memory.stat": f"inactive_file {100 * MiB}\n",
            "proc/self/status": "Name:\tpython\nVmRSS:\t    6024 kB\nRssAnon:\t    1000 kB\nRssFile:\t 5000 kB\n"
                                "RssShmem:\t 24 kB\n",
        },
    )
    probe = SystemProbe(tmp_path)
    host = psutil.virtual_memory()
    assert probe.available() == min(host.available, GiB - 500 * MiB)
    assert probe.limit() == min(host.total, GiB)
    assert probe.rss() == 6024 * 1024  # the whole resident set (VmRSS): mapped files count, as the OS counts them
