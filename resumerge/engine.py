"""Execute a plan: compute every pending tensor, stream it into its shard, commit shards and side files.

Three stages overlap: worker threads read inputs and run the merge method (torch releases the GIL), the
calling thread hands finished tensors over in plan order, and one writer thread streams them to disk, hashes
them, and runs the commit protocol (fsync, verify, rename, fsync dir, ledger row, manifest) — so the fsync of
shard k overlaps the computation of shard k+1. A stop request is honoured between tensors: the unfinished
shard's temp file is deleted and everything committed stays committed.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from resumerge import killpoints
from resumerge.durable import write_file_atomic
from resumerge.errors import ResumergeError
from resumerge.ledger import Ledger
from resumerge.manifest import ManifestBook
from resumerge.methods.registry import MergeContext, get_method
from resumerge.outputs import aux_files, render_aux
from resumerge.plan import Plan, ShardPlan, TensorPlan
from resumerge.shardwriter import ShardWriter
from resumerge.tensorio import NAME_DTYPES, TORCH_DTYPES, TensorReader


class Reporter(Protocol):
    """Receives progress; the CLI's implementation draws it with rich, a notebook may log it."""

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None: ...

    def tensor_done(self, name: str, nbytes: int) -> None: ...

    def file_done(self, name: str, kind: str) -> None: ...

    def message(self, text: str) -> None: ...


class Stopped(Exception):
    """Raised inside the engine when a stop was requested; the caller turns it into InterruptedMerge."""


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one output tensor: depends only on (seed, name), never on execution order."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def compute_tensor(plan: Plan, tp: TensorPlan, reader: TensorReader) -> torch.Tensor:
    """Read the inputs of ``tp``, run its method, and return the result in the planned dtype (contiguous)."""
    method = get_method(tp.method)
    if method is None:
        raise ResumergeError(f"internal: unknown method {tp.method}")
    tensors = []
    for ref in tp.inputs:
        t = reader.read(Path(plan.model_dirs[ref.model]) / ref.file, ref.start, ref.end, ref.dtype, ref.shape)
        if tp.compute_dtype is not None:
            t = t.to(NAME_DTYPES[tp.compute_dtype])
        tensors.append(t)
    generator = None
    if method.randomized:
        generator = torch.Generator().manual_seed(tensor_seed(plan.options.random_seed, tp.name))
    ctx = MergeContext(
        tensors=tensors,
        base_index=tp.base_index,
        model_params=[dict(p) for p in tp.model_params],
        params=dict(tp.params),
        tensor_name=tp.name,
        generator=generator,
    )
    try:
        out = method.fn(ctx)
    except ValueError as exc:
        raise ResumergeError(f"{tp.method} failed on {tp.name}: {exc}", tensor=tp.name) from exc
    return out.to(TORCH_DTYPES[tp.out_dtype]).contiguous()


class _Writer(threading.Thread):
    """Consumes (shard, name, tensor) items; commits each shard after its last tensor."""

    def __init__(self, plan: Plan, out_dir: Path, ledger: Ledger, book: ManifestBook, reporter: Reporter) -> None:
        super().__init__(name="resumerge-writer", daemon=True)
        self.plan, self.out_dir, self.ledger, self.book, self.reporter = plan, out_dir, ledger, book, reporter
        self.items: queue.Queue[tuple[ShardPlan, str, torch.Tensor] | None] = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self._current: ShardWriter | None = None

    def run(self) -> None:
        crcs: dict[str, int] = {}
        started = time.monotonic()
        try:
            while True:
                item = self.items.get()
                if item is None:
                    return
                shard, name, tensor = item
                if self._current is None:
                    self._current = ShardWriter(self.out_dir / shard.name, self.plan.shard_layout(shard))
                    crcs, started = {}, time.monotonic()
                crcs[name] = self._current.write(name, tensor)
                self.reporter.tensor_done(name, self.plan.tensors[name].nbytes)
                if self._current.expected_name is None:
                    size, sha = self._current.finish()
                    self._current = None
                    self.ledger.commit_file(
                        shard.name, size=size, sha256=sha, seconds=time.monotonic() - started, tensor_crcs=crcs
                    )
                    killpoints.reach("after_ledger_commit")
                    self.book.commit(shard.name, size, sha)
                    killpoints.reach("after_manifest_write")
                    self.reporter.file_done(shard.name, "shard")
        except BaseException as exc:
            self.error = exc
            self.abort()
            # Drain so the producer never blocks on a full queue after a failure.
            while True:
                try:
                    if self.items.get(timeout=0.2) is None:
                        return
                except queue.Empty:
                    return

    def abort(self) -> None:
        """Delete the unfinished shard's temp file."""
        if self._current is not None:
            self._current.abort()
            self._current = None


def _pending_tensors(plan: Plan, done: set[str]) -> Iterator[tuple[ShardPlan, TensorPlan]]:
    for shard in plan.shards:
        if shard.name in done:
            continue
        for name in shard.tensors:
            yield shard, plan.tensors[name]


def execute(
    plan: Plan,
    out_dir: Path,
    ledger: Ledger,
    book: ManifestBook,
    reporter: Reporter,
    *,
    should_stop: Callable[[], bool],
    config_text: str,
    workers: int = 2,
) -> None:
    """Bring every pending file of ``plan`` to committed. Raises :class:`Stopped` when ``should_stop`` turns true."""
    done = {row["name"] for row in ledger.files() if row["status"] == "done"}
    reader = TensorReader()
    writer = _Writer(plan, out_dir, ledger, book, reporter)
    writer.start()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resumerge-merge")
    inflight: deque[tuple[ShardPlan, TensorPlan, Future[torch.Tensor]]] = deque()
    stopped = False
    try:
        work = _pending_tensors(plan, done)
        while True:
            while len(inflight) < workers and not should_stop():
                nxt = next(work, None)
                if nxt is None:
                    break
                inflight.append((nxt[0], nxt[1], pool.submit(compute_tensor, plan, nxt[1], reader)))
            if not inflight or should_stop() or writer.error is not None:
                stopped = should_stop()
                break
            shard, tp, future = inflight.popleft()
            tensor = future.result()
            while writer.is_alive():
                try:
                    writer.items.put((shard, tp.name, tensor), timeout=0.2)
                    break
                except queue.Full:
                    if should_stop() or writer.error is not None:
                        break
    finally:
        for _, _, future in inflight:
            future.cancel()
        pool.shutdown(wait=True)
        if stopped or writer.error is not None:
            _stop_writer(writer, abort=True)
        else:
            _stop_writer(writer, abort=False)
        reader.close()
    if writer.error is not None:
        raise writer.error
    if stopped:
        raise Stopped()
    _write_aux(plan, out_dir, ledger, book, reporter, done, config_text, should_stop)


def _stop_writer(writer: _Writer, *, abort: bool) -> None:
    if abort:
        # Tell the writer to stop after what it holds, then throw away the unfinished shard.
        while True:
            try:
                writer.items.get_nowait()
            except queue.Empty:
                break
    writer.items.put(None)
    writer.join()
    if abort:
        writer.abort()


def _write_aux(
    plan: Plan,
    out_dir: Path,
    ledger: Ledger,
    book: ManifestBook,
    reporter: Reporter,
    done: set[str],
    config_text: str,
    should_stop: Callable[[], bool],
) -> None:
    for aux in aux_files(plan):
        if aux.name in done:
            continue
        if should_stop():
            raise Stopped()
        data = render_aux(plan, aux, config_text)
        write_file_atomic(out_dir / aux.name, data, point=aux.point)
        sha = hashlib.sha256(data).hexdigest()
        ledger.commit_file(aux.name, size=len(data), sha256=sha, seconds=0.0)
        killpoints.reach("after_ledger_commit")
        book.commit(aux.name, len(data), sha)
        reporter.file_done(aux.name, aux.kind)
