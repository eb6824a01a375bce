"""Hub to hub behind a simulated link: ``resumerge run cfg.yml hf://…`` against mergekit's three phases (issue 27);
with ``--route``, the pipeline's two halves (hub inputs to a local OUT, local inputs to an ``hf://`` OUT).

Usage::

    python bench/bench_hub_pipeline.py [--rates 50/25,150/75,500/250] [--methods linear,ties] [--runs 1]
        [--models /tmp/bench/models-1750212608] [--flags "--stream-inputs --out-shard-size 100M --commit-every 1"]
        [--before DIR] [--skip-mergekit] [--no-plan] [--transfers] [--work DIR] [--route hub-hub|hub-local|local-hub]

The stand-in hub of ``tests/hub`` (in this process, on 127.0.0.1) serves the models ``a`` and ``b`` of
``--models`` as ``bench/a`` and ``bench/b`` (held in memory, pushed once), behind a simulated link
(``tests/hub/fakehub_link.py``): every response body shares the download rate, every upload body the upload rate,
``DOWN/UP`` in MB/s. The LFS tier (``HF_HUB_DISABLE_XET=1``): in the Xet tier uploads would bypass the stand-in's
HTTP and so the link. For every rate and method (linear: a and b at 0.5; ties: base a, b at density 0.5), each
run from an empty HF cache, in fresh processes, alternating the order run by run:

- ``mergekit``: ``mergekit-yaml`` on the hub ids (it downloads), then ``HfApi().upload_folder`` to a new repo:
  mergekit's three phases as a user chains them (download+merge and upload are timed apart too);
- ``resumerge``: ``resumerge run cfg.yml hf://bench/merged-N`` with its defaults;
- ``flags`` (only with ``--flags``): the same with those options added;
- ``transfers`` (only with ``--transfers``): no merge, the same bytes moved by huggingface_hub's own clients at
  once: ``snapshot_download`` of both inputs (a thread each) while another process uploads with ``upload_folder`` the
  weights of ``--models``'s third model ``c`` (the output's size, content the hub lacks). On two cores shared with
  the stand-in this is the machine's transfer floor, which the link floor does not see;
- ``before`` (only with ``--before DIR``): ``resumerge run`` with its defaults from the code in DIR (say, an
  export of an earlier commit: ``git archive COMMIT | tar -x -C DIR``), paired with today's under the same load.

``--route hub-local`` merges the hub inputs into a local OUT (mergekit: ``mergekit-yaml`` on the hub ids alone;
transfers: the downloads alone); ``--route local-hub`` merges the local models ``a`` and ``b`` of ``--models``
into an ``hf://`` OUT (mergekit: ``mergekit-yaml`` on the local paths, then ``upload_folder``; transfers: the
upload alone). The link floor then counts the one direction that moves bytes.

Reported per row: wall; the CPU seconds of the tool's processes and of the stand-in (this process) on the
printed line; the link floor ``max(bytes down / down rate, bytes up / up rate)`` from the bytes the
stand-in counted; the ratio to the floor and to mergekit's three phases; bytes down and up; commits; the peak of
local disk the run used (HF cache, state and staging, OUT; sampled every 0.1 s). Before the runs, ``resumerge
plan cfg.yml hf://… --bandwidth DOWN/UP --json`` gives its network estimate, printed beside the measured wall.
Ends with the rows as a markdown table, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hub.fakehub import FakeHub, files_of, sha256_of  # noqa: E402
from hub.fakehub_link import Link  # noqa: E402
from hub.fakehub_write import HubWriter  # noqa: E402

MB = 10**6
TOKEN = "bench-token"
CONFIGS = {
    "linear": ("merge_method: linear\ndtype: float32\nmodels:\n  - model: bench/a\n    parameters: {weight: 0.5}\n"
               "  - model: bench/b\n    parameters: {weight: 0.5}\n"),
    "ties": ("merge_method: ties\ndtype: float32\nbase_model: bench/a\nmodels:\n  - model: bench/b\n"
             "    parameters: {weight: 1.0, density: 0.5}\nparameters: {normalize: true}\n"),
}
# The "transfers" row: no merge, huggingface_hub's own clients moving the same bytes at once: both input models
# downloaded (a thread each, snapshot_download's own workers) while another process uploads a third model of the
# same size as the output (upload_folder; new content, so the hub's LFS API does not skip it).
_DOWNLOAD = ("import sys, threading\nfrom huggingface_hub import snapshot_download\n"
             "ts = [threading.Thread(target=snapshot_download, args=(r,)) for r in sys.argv[1:]]\n"
             "[t.start() for t in ts]\n[t.join() for t in ts]\n")
_UPLOAD_WEIGHTS = ("import sys\nfrom huggingface_hub import HfApi\napi = HfApi()\napi.create_repo(sys.argv[1])\n"
                   "api.upload_folder(repo_id=sys.argv[1], folder_path=sys.argv[2],\n"
                   "                  allow_patterns=['*.safetensors'])\n")
_UPLOAD = ("import sys\nfrom huggingface_hub import HfApi\napi = HfApi()\napi.create_repo(sys.argv[1])\n"
           "api.upload_folder(repo_id=sys.argv[1], folder_path=sys.argv[2])\n")


@dataclass(frozen=True)
class Row:
    """One measured run."""

    rate: str
    method: str
    tool: str
    wall: float
    down: int
    up: int
    commits: int
    disk_peak: int
    floor: float
    phases: str = ""
    load: str = ""


def _du(root: Path) -> int:
    total = 0
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            try:
                if not os.path.islink(path):
                    total += os.stat(path).st_size
            except FileNotFoundError:
                continue
    return total


class DiskPeak(threading.Thread):
    """The largest size ``root`` reached while running, sampled every 0.1 s."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.stop = root, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _du(self.root))
            self.stop.wait(0.1)

    def __enter__(self) -> DiskPeak:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()
        self.peak = max(self.peak, _du(self.root))


def _env(hub: FakeHub, root: Path, code: Path = ROOT) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return env | {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(root / "hf"),
                  "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                  "PYTHONPATH": str(code), "PYTHONHASHSEED": "0"}


def _check(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode != 0:
        raise SystemExit(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


ROUTES = ("hub-hub", "hub-local", "local-hub")


def run_tool(tool: str, hub: FakeHub, config: Path, root: Path, repo: str, flags: list[str],
             before: Path | None, third: Path, route: str = "hub-hub") -> tuple[float, str]:
    """Run one tool from an empty HF cache; returns its wall time and, for mergekit, its two phases."""
    env = _env(hub, root, before if tool == "before" and before is not None else ROOT)
    downloads, uploads = route.startswith("hub-"), route.endswith("-hub")
    if tool == "transfers":
        started = time.perf_counter()
        upload = (subprocess.Popen([sys.executable, "-c", _UPLOAD_WEIGHTS, repo, str(third)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                  if uploads else None)
        if downloads:
            _check(subprocess.run([sys.executable, "-c", _DOWNLOAD, "bench/a", "bench/b"], env=env,
                                  capture_output=True, text=True), "snapshot_download")
        downloaded = time.perf_counter()
        if upload is not None:
            _, err = upload.communicate()
            _check(subprocess.CompletedProcess(upload.args, upload.returncode, "", err), "upload_folder")
        ended = time.perf_counter()
        return ended - started, f"downloads {downloaded - started:.1f} s, upload {ended - started:.1f} s"
    if tool == "mergekit":
        exe = shutil.which("mergekit-yaml")
        assert exe is not None, "mergekit-yaml is not on PATH"
        started = time.perf_counter()
        _check(subprocess.run([exe, str(config), str(root / "out"), "--random-seed", "0"], env=env,
                              capture_output=True, text=True), "mergekit-yaml")
        merged = time.perf_counter()
        if uploads:
            _check(subprocess.run([sys.executable, "-c", _UPLOAD, repo, str(root / "out")], env=env,
                                  capture_output=True, text=True), "upload_folder")
        ended = time.perf_counter()
        return ended - started, f"download+merge {merged - started:.1f} s, upload {ended - merged:.1f} s"
    out = f"hf://{repo}" if uploads else str(root / "out")
    argv = [sys.executable, "-m", "resumerge", "run", str(config), out, "--quiet",
            "--state-dir", str(root / "state"), *(flags if tool == "flags" else [])]
    started = time.perf_counter()
    # In the code's own folder: ``python -m`` puts the working directory first on the path, before PYTHONPATH.
    code = before if tool == "before" and before is not None else ROOT
    _check(subprocess.run(argv, env=env, capture_output=True, text=True, cwd=code), "resumerge run")
    return time.perf_counter() - started, ""


def plan_network(hub: FakeHub, config: Path, root: Path, down: float, up: float,
                 route: str = "hub-hub") -> dict[str, object] | None:
    """``resumerge plan``'s network estimate at this link (fresh cache: everything is to download)."""
    out = "hf://bench/planned" if route.endswith("-hub") else str(root / "out")
    argv = [sys.executable, "-m", "resumerge", "plan", str(config), out, "--json",
            "--state-dir", str(root / "state"), "--bandwidth", f"{down / MB:g}MB/{up / MB:g}MB"]
    done = subprocess.run(argv, env=_env(hub, root), capture_output=True, text=True)
    shutil.rmtree(root, ignore_errors=True)
    if done.returncode not in (0, 2):
        print(f"  plan failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    doc = json.loads(done.stdout)
    network, timing = doc.get("network"), doc.get("time", {})
    if not isinstance(network, dict):
        return None
    # What the local part of the estimate is made of (start-up includes planning's header reads over the link).
    return network | {key: timing.get(key) for key in ("startup_seconds", "compute_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="50/25,150/75,500/250", help="DOWN/UP in MB/s, comma-separated")
    parser.add_argument("--methods", default="linear,ties")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--models", type=Path, default=Path("/tmp/bench/models-1750212608"))
    parser.add_argument("--flags", default="", help="also run resumerge with these options (the 'flags' row)")
    parser.add_argument("--before", type=Path, default=None,
                        help="also run resumerge's defaults from the code in this folder (the 'before' row)")
    parser.add_argument("--skip-mergekit", action="store_true")
    parser.add_argument("--no-plan", action="store_true", help="skip resumerge plan's network estimate")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--transfers", action="store_true",
                        help="also the machine's transfer floor: the bytes moved by huggingface_hub alone, no merge")
    parser.add_argument("--route", choices=ROUTES, default="hub-hub",
                        help="hub inputs to hf:// OUT (default), hub inputs to a local OUT, local inputs to hf:// OUT")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-hub-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    third = args.models / "c"  # the transfers row's upload: a third model of the inputs' size
    if args.transfers and not any(third.glob("*.safetensors")):
        parser.error(f"--transfers uploads {third}: generate it with bench/bench_vs_mergekit.py")
    tools = (([] if args.skip_mergekit else ["mergekit"]) + (["transfers"] if args.transfers else [])
             + (["before"] if args.before else []) + ["resumerge"]
             + (["flags"] if args.flags else []))
    flags = shlex.split(args.flags)
    hub = FakeHub()
    writer = HubWriter.attach(hub)
    writer.add_token(TOKEN, "bench")
    sizes = {}
    for name in ("a", "b"):
        files = files_of(args.models / name)
        for data in files.values():
            sha256_of(data)  # hashed once here, never inside a timed run
        sizes[name] = sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))
        hub.push(f"bench/{name}", files)
    print(f"inputs: bench/a {sizes['a'] / 1e9:.2f} GB, bench/b {sizes['b'] / 1e9:.2f} GB (fp32); tools {tools}",
          flush=True)
    rows: list[Row] = []
    estimates: dict[tuple[str, str], dict[str, object] | None] = {}
    counter = 0
    with hub:
        for rate in args.rates.split(","):
            down, up = (float(x) * MB for x in rate.split("/"))
            hub.link = Link(down=down, up=up)
            for method in args.methods.split(","):
                config = work / f"{method}.yml"
                text = CONFIGS[method]
                if args.route == "local-hub":
                    text = text.replace("bench/a", str(args.models.resolve() / "a"))
                    text = text.replace("bench/b", str(args.models.resolve() / "b"))
                config.write_text(text)
                if not args.no_plan:
                    estimates[rate, method] = plan_network(hub, config, work / "plan", down, up, args.route)
                    print(f"{rate} {method} plan: {estimates[rate, method]}", flush=True)
                for run in range(args.runs):
                    for tool in tools if run % 2 == 0 else list(reversed(tools)):
                        counter += 1
                        repo, root = f"bench/merged-{counter}", work / f"run-{counter}"
                        shutil.rmtree(root, ignore_errors=True)
                        root.mkdir(parents=True)
                        hub.reset_counters()
                        load = _load()
                        began = time.monotonic()
                        children, ours = resource.getrusage(resource.RUSAGE_CHILDREN), os.times()
                        with DiskPeak(root) as disk:
                            wall, phases = run_tool(tool, hub, config, root, repo, flags, args.before, third,
                                                    args.route)
                        phases = (phases + "  " if phases else "") + _timeline(hub, repo, began)
                        phases += "  " + _cpu(children, ours)
                        print("    " + _spans(hub, repo, began), flush=True)
                        row = Row(rate, method, tool, wall, hub.link.down_bytes, hub.link.up_bytes,
                                  writer.commits.get(repo, 0), disk.peak,
                                  max(hub.link.down_bytes / down, hub.link.up_bytes / up), phases, load)
                        rows.append(row)
                        print(f"{rate} {method} run {run + 1} {tool:9s} wall {wall:6.1f} s  floor {row.floor:5.1f} s "
                              f"({wall / row.floor:.2f}x)  down {row.down / 1e9:.2f} GB  up {row.up / 1e9:.2f} GB  "
                              f"commits {row.commits}  disk peak {disk.peak / 1e9:.2f} GB  {phases}  load {load}",
                              flush=True)
                        if repo in hub.repos:
                            hub.drop(repo)
                        shutil.rmtree(root, ignore_errors=True)
    _table(rows, estimates, args)


def _cpu(children: resource.struct_rusage, ours: os.times_result) -> str:
    """CPU seconds (user + system) the tool's processes and the stand-in hub (this process, its disk sampler
    included) spent since the two readings: on 2 shared cores, what the link's floor does not show."""
    after, now = resource.getrusage(resource.RUSAGE_CHILDREN), os.times()
    tool = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    hub = now.user + now.system - ours.user - ours.system
    return f"cpu: tool {tool:.1f} s, stand-in {hub:.1f} s"


def _timeline(hub: FakeHub, repo: str, began: float) -> str:
    """When the last input byte went out and the first and last commits landed, in seconds from the start: the
    overlap of downloads and uploads, or its absence."""
    inputs = [t for key, t in hub.served_at.items() if key.startswith(("bench/a/", "bench/b/"))]
    commits = [t for name, t in hub.commit_times if name == repo]
    last_in = f"last input byte at {max(inputs) - began:.1f} s" if inputs else "no input served"
    if not commits:
        return last_in
    return f"{last_in}, commits at {min(commits) - began:.1f}..{max(commits) - began:.1f} s"


def _spans(hub: FakeHub, repo: str, began: float) -> str:
    """When each input file's last byte went out, and each output file's upload (began..ended) and commit, in
    seconds from the start: which download or which upload the run waited for."""
    def short(key: str) -> str:
        return key.replace("model-0000", "").replace(".safetensors", "")

    def put(key: str) -> str:
        span = hub.put_spans.get(hub.committed_oids.get(key, ""))
        return f"up {span[0] - began:.1f}..{span[1] - began:.1f} " if span else ""

    served = sorted((t, k) for k, t in hub.served_at.items()
                    if k.startswith(("bench/a/", "bench/b/")) and k.endswith(".safetensors"))
    ins = ", ".join(f"{short(k)} {t - began:.1f}" for t, k in served)
    outs = ", ".join(f"{short(k.removeprefix(repo + '/'))} {put(k)}commit {t - began:.1f}" for k, t in
                     sorted(hub.committed_at.items(), key=lambda kv: kv[1]) if k.startswith(repo + "/"))
    return f"input files done: {ins}\n    output files: {outs}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _table(rows: list[Row], estimates: dict[tuple[str, str], dict[str, object] | None],
           args: argparse.Namespace) -> None:
    print()
    print("| link MB/s | method | run | wall s | link floor s | × floor | × mergekit | down GB | up GB | commits | "
          "disk peak GB | plan estimate | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.rate, row.method, row.tool), []).append(row)
    for (rate, method, tool), runs in groups.items():
        wall = _median([r.wall for r in runs])
        floor = _median([r.floor for r in runs])
        mergekit = groups.get((rate, method, "mergekit"))
        versus = f"{wall / _median([r.wall for r in mergekit]):.2f}×" if mergekit else "–"
        estimate = estimates.get((rate, method))
        planned = "–"
        if tool != "mergekit" and estimate and estimate.get("seconds") is not None:
            planned = f"{float(str(estimate['seconds'])):.1f} s ({estimate.get('bound')})"
        last = runs[-1]
        label = {"mergekit": {"hub-local": "mergekit-yaml"}.get(args.route, "mergekit-yaml + upload_folder"),
                 "resumerge": "resumerge run (defaults)",
                 "transfers": {"hub-local": "transfers only: snapshot_download, no merge",
                               "local-hub": "transfers only: upload_folder, no merge"}.get(
                                   args.route, "transfers only: snapshot_download ∥ upload_folder, no merge"),
                 "before": "resumerge run (defaults), before", "flags": f"resumerge run {args.flags}"}[tool]
        print(f"| {rate} | {method} | {label} | {wall:.1f} | {floor:.1f} | {wall / floor:.2f}× | {versus} | "
              f"{last.down / 1e9:.2f} | {last.up / 1e9:.2f} | {last.commits} | {last.disk_peak / 1e9:.2f} | "
              f"{planned} | {last.load} |")
    print(f"\nRoute: {args.route}. Command: `python bench/bench_hub_pipeline.py {shlex.join(sys.argv[1:])}` "
          f"({args.runs} run(s) each)")


if __name__ == "__main__":
    main()
