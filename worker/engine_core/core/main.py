"""The engine core process's entry point (multiprocessing spawn): build, say Ready, serve, exit.

Runs without Ray: only the engine config (processors by FQCN) and the thread count come from the
parent. It exits when told (Shutdown), and when the parent is gone (EOF on the pipe, or a new
parent pid), so a replica that dies leaves no engine behind; its tensor-parallel ranks, which
watch this process the same way, follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from worker.config import EngineConfig
from worker.engine_core.core.engine import CoreEngine
from worker.engine_core.protocol import HEARTBEAT_S, Command, Event, Heartbeat, Ready, StartFailed

# How long a stopping core waits for its step thread and its engine to close before it exits anyway.
SHUTDOWN_TIMEOUT_S = 60.0
# How often the command reader checks that the parent is still the parent.
PARENT_CHECK_S = 1.0


def core_main(conn: Connection, engine_kwargs: dict[str, Any], num_threads: int, parent_pid: int) -> None:
    """Spawned by EngineProcess: ``engine_kwargs`` is ``EngineConfig.as_kwargs()``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the parent, which stops the core
    try:
        torch.set_num_threads(max(1, num_threads))
        stop = threading.Event()  # set on the loop thread; read by the serve loop
        sender = _Sender(conn)
        core = CoreEngine(EngineConfig(**engine_kwargs), sender.send, stop.set)
        eng = core.engine
        ready = Ready(
            pid=os.getpid(),
            kv_cache_bytes=int(eng.runner.kv_cache_bytes),
            processor_fqcns=tuple(p.fqcn for p in eng.processors.describe()),
            rank_pids=tuple(eng.runner.rank_pids()),
            num_threads=torch.get_num_threads(),
            ray_imported="ray" in sys.modules,
        )
    except BaseException as exc:  # noqa: BLE001 - raised again in the parent, with this traceback
        with contextlib.suppress(OSError):
            conn.send(StartFailed(type(exc).__name__, str(exc), traceback.format_exc()))
        raise SystemExit(1) from None
    try:
        conn.send(ready)
    except OSError:
        eng.close()
        return
    asyncio.run(_serve(core, conn, stop, sender, parent_pid))


class _Sender:
    """Sends events; after the pipe breaks (the parent is gone) it drops them and says so."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.broken = False

    def send(self, event: Event) -> None:
        if self.broken:
            return
        try:
            self.conn.send(event)
        except OSError:
            self.broken = True


async def _serve(core: CoreEngine, conn: Connection, stop: threading.Event, sender: _Sender, parent_pid: int) -> None:
    loop = asyncio.get_running_loop()
    core.start()
    reader = threading.Thread(
        target=_read_commands, args=(conn, loop, core.handle, stop, parent_pid), name="core-commands", daemon=True
    )
    reader.start()
    while not stop.is_set() and not sender.broken:
        sender.send(Heartbeat(core.stats()))
        await asyncio.sleep(HEARTBEAT_S)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(core.shutdown(), SHUTDOWN_TIMEOUT_S)
    with contextlib.suppress(OSError):
        conn.close()


def _read_commands(
    conn: Connection,
    loop: asyncio.AbstractEventLoop,
    handle: Callable[[Command], None],
    stop: threading.Event,
    parent_pid: int,
) -> None:
    """The reader thread: each command to the loop, in order; EOF or a new parent pid stops the core."""
    try:
        while not stop.is_set():
            if not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent_pid:
                    break
                continue
            cmd: Command = conn.recv()
            loop.call_soon_threadsafe(handle, cmd)
    except (EOFError, OSError, RuntimeError):  # the parent is gone, or the loop already stopped
        pass
    stop.set()
