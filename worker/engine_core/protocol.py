"""The messages between a served replica and its engine core process (pickled over one Pipe).

Commands go parent -> core, events core -> parent. Every message is a frozen dataclass, so each
side reads typed fields; no code travels (processors are named by FQCN in the engine config).
A step's outputs for every request travel in one `StepOutputs`, each with a stats snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.async_engine import EngineStats
from worker.engine import Prompt
from worker.kv import CachedBlocks
from worker.outputs import RequestOutput
from worker.request import Scheduling
from worker.sampling_params import SamplingParams

# -- parent -> core ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Admit one request; answered by `Rejected` (before any output of it) when it is invalid."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    scheduling: Scheduling | None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Pause:
    """The request's consumer is `stream_buffer_outputs` outputs behind: out of the batch, KV kept."""

    request_id: str


@dataclass(frozen=True)
class Resume:
    request_id: str


@dataclass(frozen=True)
class QueryCachedBlocks:
    """Answered by `CachedBlocksReply` with the same `query_id`."""

    query_id: int


@dataclass(frozen=True)
class Shutdown:
    """Stop stepping, close the engine (a tensor-parallel group's ranks with it), exit."""


Command = AddRequest | Abort | Pause | Resume | QueryCachedBlocks | Shutdown

# -- core -> parent ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine is built: what the replica reports about it (info(), stats())."""

    pid: int
    kv_cache_bytes: int
    processor_fqcns: tuple[str, ...]
    rank_pids: tuple[int, ...]  # a tensor-parallel group's other ranks (processes of the core)
    num_threads: int  # torch's intra-op threads in the core
    ray_imported: bool  # the core must run without Ray (nothing of the replica's process follows it)


@dataclass(frozen=True)
class StartFailed:
    """Building the engine raised: its type name, message and traceback, raised in the parent."""

    error_type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Rejected:
    """An `AddRequest` that `LLMEngine.prepare` refused (error_type "ValueError": bad input)."""

    request_id: str
    error_type: str
    message: str


@dataclass(frozen=True)
class StepOutputs:
    """One engine step's delta outputs, every request's in one message. A request's first output
    carries its prompt and prompt ids; later ones carry none (the parent has them)."""

    outputs: tuple[RequestOutput, ...]
    stats: EngineStats


@dataclass(frozen=True)
class Heartbeat:
    """Sent at least every HEARTBEAT_S whatever the engine does: the core's loop is alive."""

    stats: EngineStats


@dataclass(frozen=True)
class CachedBlocksReply:
    query_id: int
    blocks: CachedBlocks | None  # None: the engine loop is dead
    error: str = ""


@dataclass(frozen=True)
class EngineFailed:
    """The engine loop died (a step raised): every open request fails, no new one is taken."""

    error: str


Event = Ready | StartFailed | Rejected | StepOutputs | Heartbeat | CachedBlocksReply | EngineFailed

# How often the core sends a Heartbeat (the parent's liveness bound is many of these).
HEARTBEAT_S = 0.25
