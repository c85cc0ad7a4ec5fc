"""The padded static decode path: pure-decode steps at fixed shapes, replayed as CUDA graphs.

A decode step of an eager engine launches every kernel of the model from Python (hundreds per
layer on a GPU: host time, not the device, bounds it). Here a step whose every row decodes one
token runs at a fixed shape instead: the batch padded to the next bucket of a fixed list (vLLM's
capture sizes, 1, 2, 4, 8, 16, 24, ... clamped to ``max_num_seqs``), each row's block table cut
to the next width bucket of a fixed ladder, all inputs in static buffers allocated once and
filled in place (token ids, positions, slots, context lengths: one host-to-device copy; the
block table: the persistent ``BlockTable``'s rows). Padding rows decode token 0 at position 0
into the reserved null block (a block the KV manager never hands out) and their logits are
dropped. On CUDA each (rows, width) bucket is captured once into a ``torch.cuda.CUDAGraph`` at
start-up (after the KV pool exists, largest first, one warm-up each, one shared memory pool) and
a step is a replay; elsewhere the very same path runs eagerly (what CI tests on CPU).

The attention is the torch backend's decode (gather over the fixed-width table, then SDPA under
a per-row length mask; GQA, windows and softcap as on the dynamic path): no Python branch on a
tensor value and no host read, so the whole forward is capturable. Cascade attention is off
here. Logits of a replay land in one static buffer shared by every graph and are copied out,
so a caller may keep them past the next step.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from worker.model.attention import METADATA_KWARG, DecodeRows, StepMetadata
from worker.model.block_table import BlockTable
from worker.model.gather import head_major
from worker.ops.staging import int64_tensor

if TYPE_CHECKING:
    from worker.model.runner import ScheduledSeq, TokenFeed

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 (clamped to max_num_seqs).
MAX_BUCKET = 512
# Width buckets: the full table, then each a quarter of the one above (CUDA: each is one more
# graph per batch bucket) or a half (eager: no capture, so a finer ladder only saves work).
WIDTH_STEP = {"graphs": 4, "eager": 2}
MIN_WIDTH = 4  # blocks: no narrower width bucket than this

StaticMode = Literal["off", "eager", "graphs"]


def resolve_mode(cuda_graphs: bool | None, device: torch.device, *, sharded: bool) -> StaticMode:
    """``EngineConfig.cuda_graphs`` on ``device``: None = graphs on CUDA for one process (capture of
    a tensor-parallel group's collectives is not yet verified on a GPU: opt in with True), else off;
    True = graphs on CUDA, the padded path eagerly on CPU; refused elsewhere."""
    if cuda_graphs is None:
        return "graphs" if device.type == "cuda" and not sharded else "off"
    if not cuda_graphs:
        return "off"
    if device.type == "cuda":
        return "graphs"
    if device.type == "cpu":
        return "eager"
    raise ValueError(f"cuda_graphs: the padded decode path runs on CUDA (graphs) or CPU (eager), not {device.type}")


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes a decode step is padded to: 1, 2, 4, 8, 16, 24, ... below ``max_num_seqs``
    (and MAX_BUCKET), then ``max_num_seqs`` itself (so every decode step of the engine fits)."""
    top = min(max_num_seqs, MAX_BUCKET)
    sizes = [1, 2, 4, *range(8, MAX_BUCKET + 1, 8)]
    return (*(b for b in sizes if b < top), top)


def width_buckets(max_blocks: int, step: int) -> tuple[int, ...]:
    """Table widths (blocks), ascending: ``max_blocks``, then 1/step of it, ... down to MIN_WIDTH."""
    widths = [max_blocks]
    while widths[-1] > MIN_WIDTH:
        widths.append(max(MIN_WIDTH, -(-widths[-1] // step)))
    return tuple(sorted(set(widths)))


def _bucket(sizes: tuple[int, ...], n: int) -> int:
    return next(b for b in sizes if b >= n)


@dataclass(frozen=True)
class CaptureReport:
    """What start-up captured, for its log line."""

    buckets: tuple[tuple[int, int], ...]  # (rows, width in blocks), in capture order
    seconds: float
    pool_bytes: int  # device memory the graphs' shared pool holds

    def describe(self) -> str:
        rows = sorted({r for r, _ in self.buckets})
        widths = sorted({w for _, w in self.buckets})
        return (
            f"cuda graphs: captured {len(self.buckets)} decode graphs (batch buckets {rows} x table widths "
            f"{widths} blocks) in {self.seconds:.2f} s; graph pool {self.pool_bytes / 2**20:.1f} MiB"
        )


class StaticDecode:
    """Static buffers, the bucket choice and the forward of the padded decode path (one runner's)."""

    def __init__(
        self,
        model: torch.nn.Module,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
        *,
        mode: StaticMode,
        max_num_seqs: int,
        block_size: int,
        max_model_len: int,
        table: BlockTable,
        copied: torch.cuda.Event | None,
        no_mask: torch.Tensor,
        workspace: dict[str, torch.Tensor],
    ) -> None:
        """``table``: the runner's persistent block table, synced by it before ``run`` (its null
        block pads). ``copied``: the runner's event, recorded after this path's copies out of its
        host buffers (the runner waits on it before rewriting them). ``workspace``: the gather
        buffers, preallocated here at the largest bucket and never grown after (a graph keeps their
        addresses)."""
        assert mode != "off"
        self.mode: StaticMode = mode
        self._model = model
        self._k, self._v = k_cache, v_cache
        self.block_size = block_size
        self.null_block = null_block = table.null_block
        self._no_mask = no_mask
        kv_heads, num_blocks, _, dim = k_cache[0].shape
        self._kv_heads, self._pool_blocks = kv_heads, num_blocks
        device = k_cache[0].device
        self.device = device
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.widths = width_buckets(self.max_blocks, WIDTH_STEP[mode])
        rows = self.buckets[-1]
        cuda = device.type == "cuda"
        self.table = table
        # ids, positions, slots, context lengths of every row: one host-to-device copy per step. A
        # bucket of r rows reads the first 4r entries as [4, r] (``_rows_inputs``): contiguous on
        # both sides, so the copy is one async memcpy. (A [4, r] slice of a [4, max] buffer is
        # strided: torch first copies a strided source into a pageable temporary, and CUDA syncs
        # the stream before a copy from pageable memory: the host waited for the last step.)
        self._inputs = torch.zeros(4 * rows, dtype=torch.long, device=device)
        self._staging = torch.zeros(4 * rows, dtype=torch.long, pin_memory=cuda) if cuda else None
        self._table = torch.full((rows, self.max_blocks), null_block, dtype=torch.int32, device=device)
        self._token_index = torch.arange(rows, device=device)
        self._copied = copied
        gather_rows = kv_heads * rows * self.max_blocks
        for name in ("k", "v"):
            buf = workspace.get(name)
            if buf is None or buf.shape[0] < gather_rows:
                workspace[name] = k_cache[0].new_empty((gather_rows, block_size * dim))
        self._workspace = {"k": workspace["k"], "v": workspace["v"]}  # this path's own references
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [rows, vocab]: every graph's output
        self.bucket_steps: collections.Counter[tuple[int, int]] = collections.Counter()  # steps per (rows, width)

    @property
    def num_steps(self) -> int:
        return self.bucket_steps.total()

    def fits(self, seqs: Sequence[ScheduledSeq]) -> bool:
        """A pure-decode step: every row one sampled token, no prompt logits, within the largest bucket."""
        return len(seqs) <= self.buckets[-1] and all(
            len(s.token_ids) == 1 and s.sample and not s.prompt_logits for s in seqs
        )

    # ------------------------------------------------------------------ inputs

    def _fill(self, seqs: Sequence[ScheduledSeq], used: Sequence[int]) -> tuple[int, int]:
        """Write the step into the static buffers; return its (rows, width) bucket. ``used``: each
        row's blocks in use (the runner has synced the block table's rows to them)."""
        n = len(seqs)
        rows = _bucket(self.buckets, n)
        pad = rows - n
        bs = self.block_size
        ids, pos, slots, lens = [], [], [], []
        for s in seqs:
            p = s.start_pos
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
            lens.append(p + 1)
        width = _bucket(self.widths, max(used, default=1))
        flat = int64_tensor(
            [*ids, *[0] * pad, *pos, *[0] * pad, *slots, *[self.null_block * bs] * pad, *lens, *[1] * pad]
        )
        if self._staging is not None:
            self._staging[: 4 * rows].copy_(flat)
            flat = self._staging[: 4 * rows]
        self._inputs[: 4 * rows].copy_(flat, non_blocking=True)
        self._table[:rows].copy_(self.table.table[:rows], non_blocking=True)  # rows past the step's: null
        if self._copied is not None:
            self._copied.record()
        return rows, width

    def _rows_inputs(self, rows: int) -> torch.Tensor:
        """The ``[4, rows]`` inputs a bucket of ``rows`` reads (a fixed address per bucket)."""
        return self._inputs[: 4 * rows].view(4, rows)

    def _fill_padding(self, rows: int) -> None:
        """Every row of bucket ``rows`` a padding row (capture runs on these)."""
        pad = torch.tensor([0, 0, self.null_block * self.block_size, 1])
        self._rows_inputs(rows).copy_(pad[:, None].expand(4, rows))  # start-up: a blocking copy is fine
        self._table.fill_(self.null_block)

    # ------------------------------------------------------------------ the forward

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        """The model over the first ``rows`` static rows at ``width`` blocks: logits [rows, vocab]."""
        ids, pos, slots, lens = self._rows_inputs(rows)
        table = self._table[:rows, :width].long()
        decode = DecodeRows(
            self._token_index[:rows],
            table,
            head_major(table.reshape(-1), self._kv_heads, self._pool_blocks),
            lens,
            width * self.block_size,
        )
        meta = StepMetadata(self._k, self._v, slots, decode, (), self._workspace, None, "torch")
        out = self._model(
            input_ids=ids[None],
            attention_mask=self._no_mask,
            position_ids=pos[None],
            use_cache=False,
            logits_to_keep=0,
            **{METADATA_KWARG: meta},
        )
        return out.logits[0]

    def run(self, seqs: Sequence[ScheduledSeq], used: Sequence[int], feed: TokenFeed | None = None) -> torch.Tensor:
        """One pure-decode step (``fits``): logits [len(seqs), vocab], in seqs order. ``feed``:
        rows whose token is still on the device, written into the static ids before the replay."""
        rows, width = self._fill(seqs, used)
        if feed is not None:
            feed.write(self._rows_inputs(rows)[0], feed.seqs)
        self.bucket_steps[(rows, width)] += 1
        graph = self._graphs.get((rows, width))
        if graph is None:
            return self._forward(rows, width)[: len(seqs)]
        graph.replay()
        assert self._logits is not None
        return self._logits[: len(seqs)].clone()

    # ------------------------------------------------------------------ capture (CUDA)

    def capture(self) -> CaptureReport:
        """Capture every (rows, width) bucket, largest first, into graphs sharing one pool."""
        assert self.mode == "graphs"
        torch.cuda.synchronize(self.device)
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        order = [(r, w) for r in reversed(self.buckets) for w in reversed(self.widths)]
        pool = None
        with torch.inference_mode():
            for rows, width in order:
                self._fill_padding(rows)
                first = self._forward(rows, width)  # warm-up: kernels chosen, workspaces allocated
                if self._logits is None:
                    self._logits = torch.empty(
                        (self.buckets[-1], first.shape[-1]), dtype=first.dtype, device=self.device
                    )
                del first
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        self._logits[:rows].copy_(self._forward(rows, width))
                except Exception as exc:
                    raise RuntimeError(
                        f"cuda_graphs: capturing the decode step at {rows} rows x {width} blocks failed "
                        f"({type(exc).__name__}: {exc}); this model's forward is not capturable: set cuda_graphs: false"
                    ) from exc
                pool = graph.pool() if pool is None else pool
                self._graphs[(rows, width)] = graph
        torch.cuda.synchronize(self.device)
        report = CaptureReport(
            tuple(order), time.perf_counter() - start, torch.cuda.memory_reserved(self.device) - before
        )
        logger.info("%s", report.describe())
        return report

    def describe(self) -> str:
        """The start-up line of the eager path (the graphs' is ``CaptureReport.describe``)."""
        return (
            f"padded static decode path (eager on {self.device.type}): batch buckets {list(self.buckets)}, "
            f"table widths {list(self.widths)} blocks; null block {self.null_block}"
        )
