"""A method's independent blocks of positions spread over threads (:data:`~resumerge.methods.spec.Spread`), each
thread running its kernels serially.

Where the engine merges a whole tensor with its kernels on the calling thread alone (its workers fill torch's
threads: :mod:`resumerge.inputs.kernels`), a generation's candidate is merged by the pass's one thread while the
other cores idle. A method whose work is blocks that each write only their own positions (the task-vector combine)
can take them on several threads instead: every block runs the same kernels, serially, on whichever thread takes
it, so the bits are those of the blocks run in order.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from resumerge.inputs.kernels import serial_kernels
from resumerge.methods.spec import Spread


def spread_over(threads: int) -> Spread:
    """A :data:`~resumerge.methods.spec.Spread` over ``threads`` threads: the calling one (whose kernels run
    serially already) and ``threads - 1`` started for the call, each taking the next block not taken; what one
    raises is raised once all have stopped."""

    def spread(count: int, worker: Callable[[], Callable[[int], None]]) -> None:
        helpers = min(threads, count) - 1
        if helpers < 1:
            each = worker()
            for k in range(count):
                each(k)
            return
        taken = itertools.count()  # next() on it is one C call: no two threads take the same block
        failures: list[BaseException] = []

        def run() -> None:
            each = worker()
            while not failures and (k := next(taken)) < count:
                each(k)

        def helper() -> None:
            try:
                with serial_kernels():
                    run()
            except BaseException as exc:  # raised on the calling thread, once every thread has stopped
                failures.append(exc)

        started = [threading.Thread(target=helper, name="resumerge-blocks", daemon=True) for _ in range(helpers)]
        for thread in started:
            thread.start()
        try:
            run()
        except BaseException as exc:
            failures.append(exc)
        finally:
            for thread in started:
                thread.join()
        if failures:
            raise failures[0]

    return spread
