"""Tensor parallelism inside one worker replica: rank 0 in the engine's process, ranks 1..N-1 as
processes it starts (``spawn``), joined by one torch.distributed group (gloo on CPU, NCCL on GPU).

Rank 0 keeps the scheduler, the persistent batch, the processors and the sampler; every rank holds
a shard of every layer and of its KV cache (``worker.model.shard``). Each step rank 0 rings the
other ranks (a byte on a pipe: an idle engine is not a collective that times out) and broadcasts
the step's inputs once, as one int32 tensor: for every scheduled sequence its block table, token
ids, start position and what it returns. From those every rank builds the same step metadata
(positions, slots, the cascade split) with the same code, runs its shard, and the collectives
inside the forward join them; rank 0 alone gets the gathered logits.

A rank that dies, or a collective that times out (``collective_timeout_s``), breaks the group: the
step's requests fail, every later step fails at once, and ``healthy`` turns false, so the replica
is replaced. A rank whose parent process is gone exits on its own.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from worker.config import EngineConfig
from worker.model.loader import LoadedModel, resolve_device
from worker.model.memory import RankMemory, cuda_memory, weight_bytes
from worker.model.profile import KVSize, kv_size
from worker.model.runner import ModelRunner, ScheduledSeq, TokenFeed, block_bytes
from worker.model.shard import CommStats
from worker.model.shard_loader import ReadStats, load_shard

logger = logging.getLogger(__name__)

_HEADER = 2  # [number of sequences, int32s used]
_PER_SEQ = 5  # [blocks, tokens, start_pos, sample, prompt_logits], then the blocks and the tokens
_STEP, _STOP = "step", "stop"


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load its shard (sent to each rank process at start)."""

    model: str
    dtype: str
    device_type: str  # "cpu" or "cuda" (rank r uses cuda:r)
    world_size: int
    init_file: str  # the group's rendezvous (one node: a file)
    timeout_s: float
    parent_pid: int
    memory: RankMemory | None  # each rank's device figures for KV sizing; None: kv_cache_bytes or CPU


@dataclass(frozen=True)
class RunnerSpec:
    """The step limits, decided on rank 0 once every shard is loaded; each rank sizes its KV."""

    config: EngineConfig
    max_model_len: int
    capacity: int  # int32s of the step broadcast


@dataclass(frozen=True)
class RankReport:
    """What a rank holds, told to rank 0 for the start-up log."""

    rank: int
    weights: int  # bytes of its shard's parameters and buffers
    kv: KVSize  # the pool its own device had room for (the group runs the smallest)


@dataclass(frozen=True)
class GroupMemory:
    """Every rank's weights and KV, the blocks the group runs, and what would fit."""

    reports: list[RankReport]
    num_blocks: int
    one_sequence_kv: int  # bytes of one max_model_len sequence's KV on one rank

    def largest_model(self) -> int | None:
        """Weight bytes the group holds at this tensor_parallel_size (None: not sized on a GPU):
        the smallest rank's share less its activation peak and one sequence's KV, times N."""
        budgets = [r.kv.budget for r in self.reports]
        if any(b is None for b in budgets):
            return None
        return len(budgets) * min(b.largest_weights(self.one_sequence_kv) for b in budgets if b is not None)

    def describe(self) -> str:
        ranks = "; ".join(
            f"rank {r.rank}: {r.weights / 2**20:.1f} MiB weights, room for {r.kv.num_blocks} KV blocks"
            for r in self.reports
        )
        line = f"tensor parallel: {len(self.reports)} ranks, {self.num_blocks} KV blocks on every rank ({ranks})"
        largest = self.largest_model()
        if largest is not None:
            line += f"; the largest model that fits at this tensor_parallel_size: {largest / 2**30:.2f} GiB of weights"
        return line


def group_min(num_blocks: int, device: torch.device) -> int:
    """The fewest blocks any rank has room for: every rank runs that many (one collective)."""
    t = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def step_capacity(config: EngineConfig, max_model_len: int) -> int:
    """The longest step, encoded: every sequence's header and block table, and the token budget."""
    blocks = -(-max_model_len // config.block_size)
    return _HEADER + config.max_num_seqs * (_PER_SEQ + blocks) + config.max_num_batched_tokens


def encode_step(seqs: list[ScheduledSeq], out: torch.Tensor, block_size: int) -> None:
    """``seqs`` into ``out`` (each block table cut to the blocks the step touches)."""
    flat: list[int] = [len(seqs), 0]
    for s in seqs:
        used = -(-(s.start_pos + len(s.token_ids)) // block_size)
        flat += [used, len(s.token_ids), s.start_pos, int(s.sample), s.prompt_logits]
        flat += s.block_ids[:used]
        flat += s.token_ids
    if len(flat) > out.numel():
        raise ValueError(f"a step of {len(flat)} int32s exceeds the broadcast's {out.numel()}")
    flat[1] = len(flat)
    out[: len(flat)].copy_(torch.tensor(flat, dtype=torch.int32))


def decode_step(buf: torch.Tensor) -> list[ScheduledSeq]:
    """The sequences ``encode_step`` wrote."""
    n, used = buf[:_HEADER].tolist()
    flat = buf[:used].tolist()
    seqs, i = [], _HEADER
    for _ in range(n):
        blocks, tokens, start, sample, prompt = flat[i : i + _PER_SEQ]
        i += _PER_SEQ
        table = flat[i : i + blocks]
        ids = flat[i + blocks : i + blocks + tokens]
        i += blocks + tokens
        seqs.append(ScheduledSeq(table, ids, start, bool(sample), prompt))
    return seqs


def _rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _init_group(spec: RankSpec, rank: int) -> None:
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{spec.init_file}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


def load_rank(spec: RankSpec, rank: int, stats: CommStats) -> LoadedModel:
    """Rank ``rank``'s shard on its device, read shard by shard from the checkpoint
    (``worker.model.shard_loader``: the families it cannot read so load whole and are sliced)."""
    device = _rank_device(spec.device_type, rank)
    return load_shard(spec.model, spec.dtype, device, rank, spec.world_size, stats, ReadStats())


# -- ranks 1..N-1 ---------------------------------------------------------------------------


def _recv(conn: Connection, parent_pid: int) -> Any:
    """The next message from rank 0; exits when rank 0's process is gone."""
    while not conn.poll(1.0):
        if os.getppid() != parent_pid:
            raise SystemExit(0)
    return conn.recv()


def rank_main(rank: int, spec: RankSpec, conn: Connection) -> None:
    """A rank process: load the shard, build its runner, run every step rank 0 rings for."""
    try:
        if spec.device_type == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        _init_group(spec, rank)
        memory = spec.memory(rank, _rank_device(spec.device_type, rank)) if spec.memory else None
        start = memory.snapshot() if memory is not None else None  # before the weights load
        loaded = load_rank(spec, rank, CommStats())
        conn.send(("loaded", None))
        rs: RunnerSpec = _recv(conn, spec.parent_pid)
        own = kv_size(loaded, rs.config, rs.max_model_len, memory, start, sample=False)
        num_blocks = group_min(own.num_blocks, loaded.device)
        runner = ModelRunner.for_config(loaded, rs.config, num_blocks=num_blocks, max_model_len=rs.max_model_len)
        buf = torch.zeros(rs.capacity, dtype=torch.int32, device=loaded.device)
        conn.send(("ready", RankReport(rank, weight_bytes(loaded.model), own)))
        while _recv(conn, spec.parent_pid) == _STEP:
            dist.broadcast(buf, src=0)
            runner.execute(decode_step(buf.cpu()))
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - told to rank 0, which fails the group
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# -- rank 0 -----------------------------------------------------------------------------------


class TensorParallelGroup:
    """Rank 0's handle on the group: the rank processes, their pipes, the step broadcast."""

    def __init__(self, config: EngineConfig, memory: RankMemory = cuda_memory) -> None:
        """``memory``: each rank's device figures for KV sizing (CUDA's; only tests give others)."""
        if config.model is None:
            raise ValueError("model: a tensor-parallel engine loads its shards from a named model")
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: this process already holds a torch.distributed group")
        self.world_size = config.tensor_parallel_size
        self.timeout_s = config.collective_timeout_s
        self.stats = CommStats()
        self.broken: str | None = None
        device = resolve_device(config.device)
        visible = torch.cuda.device_count() if device.type == "cuda" else self.world_size
        if visible < self.world_size:  # rank r runs on cuda:r of this process's devices
            raise ValueError(
                f"tensor_parallel_size: {self.world_size} ranks need {self.world_size} visible GPUs, this process "
                f"sees {visible} (under Ray a replica sees its first bundle's GPUs: serve_config.rank_placement)"
            )
        self._dir = tempfile.mkdtemp(prefix="logitpool-tp-")
        self.spec = RankSpec(
            config.model,
            config.dtype,
            device.type,
            self.world_size,
            os.path.join(self._dir, "rendezvous"),
            config.collective_timeout_s,
            os.getpid(),
            memory if config.kv_cache_bytes is None else None,
        )
        self._memory = self.spec.memory(0, device) if self.spec.memory else None
        self._start = self._memory.snapshot() if self._memory is not None else None
        ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        try:
            for rank in range(1, self.world_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=rank_main, args=(rank, self.spec, theirs), daemon=True, name=f"tp-rank-{rank}"
                )
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
            _init_group(self.spec, 0)
            self.loaded = load_rank(self.spec, 0, self.stats)
            self._expect("loaded")
        except BaseException:
            self.close()
            raise
        self._buf: torch.Tensor | None = None

    def _expect(self, what: str) -> list[Any]:
        """Every rank reports ``what`` within the timeout (their details), or the group fails to start."""
        details = []
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(self.timeout_s):
                raise RuntimeError(f"tensor-parallel rank {rank} did not report {what!r} in {self.timeout_s:g} s")
            kind, detail = conn.recv()
            if kind != what:
                raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{detail}")
            details.append(detail)
        return details

    def runner(self, config: EngineConfig, *, max_model_len: int, capacity: int) -> TensorParallelRunner:
        """Every rank sizes its KV pool on its own device (profiled together on GPUs), the group
        takes the smallest, and rank 0's runner is built; ``self.memory`` says what each holds."""
        for conn in self._conns:
            conn.send(RunnerSpec(config, max_model_len, capacity))
        own = kv_size(self.loaded, config, max_model_len, self._memory, self._start)
        self.kv = own  # rank 0's, the budget the engine reports
        bs = config.block_size
        num_blocks = group_min(own.num_blocks, self.loaded.device)
        runner = TensorParallelRunner.for_config(
            self.loaded, config, num_blocks=num_blocks, max_model_len=max_model_len
        )
        runner.group = self
        self._buf = torch.zeros(capacity, dtype=torch.int32, device=self.loaded.device)
        reports = [RankReport(0, weight_bytes(self.loaded.model), own), *self._expect("ready")]
        one_sequence = -(-max_model_len // bs) * block_bytes(self.loaded, bs)
        self.memory = GroupMemory(reports, num_blocks, one_sequence)
        logger.info("%s", self.memory.describe())
        return runner

    def pids(self) -> list[int]:
        """The rank processes' ids (ranks 1..N-1)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def healthy(self) -> bool:
        if self.broken is None and not all(p.is_alive() for p in self._procs):
            dead = [p.name for p in self._procs if not p.is_alive()]
            self.broken = f"tensor-parallel ranks exited: {', '.join(dead)}"
        return self.broken is None

    def begin_step(self, seqs: list[ScheduledSeq], block_size: int) -> None:
        """Ring every rank and broadcast the step's inputs; raises once the group is broken."""
        if not self.healthy():
            raise RuntimeError(self.broken)
        assert self._buf is not None
        encode_step(seqs, self._buf, block_size)
        try:
            for conn in self._conns:
                conn.send(_STEP)
            buf = self._buf
            self.stats.timed("broadcast", buf, lambda: dist.broadcast(buf, src=0))
        except Exception as exc:
            self.broken = f"tensor-parallel step broadcast failed: {exc}"
            raise

    def fail(self, exc: BaseException) -> None:
        """A collective inside the forward failed: the ranks are out of step for good."""
        self.broken = f"tensor-parallel forward failed: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        """Stop every rank (and kill those that do not stop in time); leave the group."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(_STOP)
        for proc in self._procs:
            proc.join(self.timeout_s if self.broken is None else 1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        self._procs, self._conns = [], []
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: the step goes to every rank first, then rank 0 runs its own shard."""

    group: TensorParallelGroup  # set by TensorParallelGroup.runner, which builds it

    def execute(self, seqs: Sequence[ScheduledSeq], feed: TokenFeed | None = None) -> torch.Tensor:
        if feed is not None:  # the other ranks build their inputs from the host's token ids
            raise ValueError("async_scheduling: not with tensor_parallel_size > 1")
        if not seqs:
            return super().execute(seqs)
        self._check(seqs)  # a step the other ranks would refuse never reaches them
        self.group.begin_step(list(seqs), self.block_size)
        try:
            return super().execute(seqs)
        except Exception as exc:
            self.group.fail(exc)
            raise

    def healthy(self) -> bool:
        return self.group.healthy()

    def rank_pids(self) -> list[int]:
        return self.group.pids()

    def close(self) -> None:
        self.group.close()
