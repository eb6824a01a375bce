"""The next decoder layer's weights read on a worker thread while the current layer runs: a pass over a merge never
written (:class:`~resumerge.merge.engine.unwritten.UnwrittenMerge`) merges each tensor as it is read, on one core,
while the texts' forward waits for it (about a fifth of the importance pass of the K-quant route's bench, one core
idle meanwhile). Read ahead, the merge of layer l + 1 runs beside layer l's forward.

The values are those the pass's own thread would read: the same reads
(:meth:`~resumerge.forward.engine.stream.ModelStream.reads`), each merged by the run's code, its kernels' threads the
count the pass's thread has (a merge's bits may depend on it), handed to
:meth:`~resumerge.forward.engine.stream.ModelStream.loaded` as its ``read``. Only where the pass declared room for it:
its caller judges that its step holds a layer read ahead beside the one running (:func:`ahead_fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

from resumerge.inputs.kernels import kernel_threads
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.forward.engine.stream import ModelStream


def ahead_fits(layer: int, largest_merge: int, merge: int) -> bool:
    """Whether a pass whose step holds a decoder layer's values (``layer`` bytes) and the working set of the
    largest tensor's merge it reads (``merge``: its input embeddings', its head's) holds, within that step, a layer
    read ahead while another runs: that layer's values and the working set of the largest merge of a layer's tensor
    (``largest_merge``) within the room kept for ``merge``, unused while a layer runs."""
    return layer + largest_merge <= merge


class ReadAhead:
    """Each decoder layer of ``stream`` read on one worker thread (``pool``) while the one before it runs
    (:meth:`start`, then :meth:`take`); a layer whose weights :meth:`~resumerge.forward.engine.stream.ModelStream.reads`
    cannot name is read as it loads (:meth:`take` gives None)."""

    def __init__(self, stream: ModelStream, pool: ThreadPoolExecutor) -> None:
        self.stream, self.pool = stream, pool
        self._pending: tuple[int, Future[dict[str, torch.Tensor]]] | None = None

    def start(self, index: int) -> None:
        """Start reading layer ``index`` (nothing past the last layer)."""
        if index >= self.stream.layers:
            return
        keys = self.stream.reads(self.stream.layers_list[index])
        if keys is None:
            return
        threads = torch.get_num_threads()  # this thread's: the merges' kernels run as they would here
        self._pending = index, self.pool.submit(self._read, keys, threads)

    def take(self, index: int) -> Callable[[str], torch.Tensor] | None:
        """Layer ``index``'s weights read ahead, once each (the ``read`` of
        :meth:`~resumerge.forward.engine.stream.ModelStream.loaded`), once they are; None where they were not
        started."""
        if self._pending is None or self._pending[0] != index:
            return None
        values = self._pending[1].result()
        self._pending = None
        return values.pop

    def _read(self, keys: list[str], threads: int) -> dict[str, torch.Tensor]:
        with kernel_threads(threads, process_wide=False):
            return {key: self.stream.reader.read(key) for key in keys}


@contextmanager
def reading_ahead(stream: ModelStream, ahead: bool) -> Iterator[ReadAhead | None]:
    """A :class:`ReadAhead` of ``stream`` for the block where ``ahead`` (else None), its worker waited for as the
    block ends (a read under way when the pass stops is let finish, and dropped)."""
    if not ahead:
        yield None
        return
    with ThreadPoolExecutor(1, thread_name_prefix="resumerge-ahead") as pool:
        yield ReadAhead(stream, pool)
