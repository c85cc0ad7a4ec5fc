"""Starting the engine core process and waiting (bounded) for it to say Ready."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
import types
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from worker.config import EngineConfig
from worker.engine_core.core.main import core_main
from worker.engine_core.protocol import Ready, StartFailed

# How long the core may take to build its engine (load the weights, size the KV pool, capture
# CUDA graphs, start tensor-parallel ranks) before the replica gives up on it.
START_TIMEOUT_S = 900.0
# How often the wait checks that the core is still alive (a core that dies is seen within this).
_POLL_S = 0.5


class EngineStartError(RuntimeError):
    """The engine core process did not come up (its traceback, when it had one to send)."""


@contextlib.contextmanager
def _bare_main() -> Iterator[None]:
    """Spawn re-imports the parent's __main__ in the child when it is a script; a Ray worker's
    is default_worker.py, which imports Ray. The core needs nothing of it, so the child is shown
    an empty one while the process starts (start() pickles what the child prepares from)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def start_core(config: EngineConfig, num_threads: int) -> tuple[BaseProcess, Connection]:
    """The core process, started with ``config`` (processors by FQCN) and its torch thread count."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    # Not a daemon: a daemonic process may not start children, and a tensor-parallel core starts
    # its ranks. It exits by itself when this process is gone (EOF), and close() bounds the rest.
    proc = ctx.Process(
        target=core_main,
        args=(theirs, config.as_kwargs(), num_threads, os.getpid()),
        name="logitpool-engine-core",
        daemon=False,
    )
    with _bare_main():
        proc.start()
    theirs.close()  # the child holds its end: our copy closed, its death is EOF here
    return proc, ours


def wait_ready(proc: BaseProcess, conn: Connection, timeout_s: float = START_TIMEOUT_S) -> Ready:
    """The core's Ready, or its start-up error raised here (ValueError stays ValueError: bad
    config is a clear error); never waits past ``timeout_s``, nor on a core that died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(_POLL_S):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                proc.join(5.0)
                raise EngineStartError(f"engine core exited during start-up (exit code {proc.exitcode})") from None
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, StartFailed):
                proc.join(5.0)
                text = f"{msg.message}\n\nengine core traceback:\n{msg.traceback}"
                if msg.error_type == "ValueError":
                    raise ValueError(text)
                raise EngineStartError(f"engine core failed to start: {msg.error_type}: {text}")
            continue  # nothing else is sent before Ready
        if not proc.is_alive():
            raise EngineStartError(f"engine core exited during start-up (exit code {proc.exitcode})")
    raise EngineStartError(f"engine core not ready within {timeout_s:g} s")
