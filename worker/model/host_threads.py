"""One OpenMP team per engine process: building an engine runs on a thread that ends.

torch's CPU ops run their parallel regions on libgomp, and a thread that has run one keeps its
team of OpenMP worker threads until it exits. Once a process holds more OpenMP threads than CPUs,
libgomp cuts the spin-wait of every waiting worker from about 300,000 iterations to 100
("throttled"), so each of a step's thousands of small parallel regions waits on futex wake-ups.
The thread that loaded the model (and ran the profiling forward) idled beside the engine thread
with its team, and an AsyncEngine on the 80M model served 15 % fewer tokens per second for it
(docs/benchmarks.md, "Host threads"). Building on a thread that ends leaves the thread that steps
the engine the only one holding a team. No environment variable lifts the throttle (``OMP_WAIT_POLICY=active`` only
raises it to 1,000 spins).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def on_own_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread, joined: its result, or its exception raised here.

    The caller blocks exactly as long as the call itself would; what the call leaves behind that
    belongs to its thread (OpenMP workers, thread-local state) ends with that thread.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            error.append(exc)

    name = f"logitpool-build-{getattr(fn, '__name__', 'call')}"
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


__all__ = ["on_own_thread"]
