"""ModelRunner: owns the paged KV storage and runs one flattened forward per engine step.

KV lives in one pool of fixed-size blocks per layer, ``[kv_heads, num_blocks, block_size,
head_dim]``, allocated once (head-major: a gathered context is one contiguous matrix per head,
which CPU SDPA reads fastest). The runner keeps no per-request state: each
scheduled sequence brings its block table (``worker.kv`` does the bookkeeping), so moving or
swapping rows of the persistent batch copies no KV, and blocks shared by a cached prefix are
simply listed in several tables. Each step flattens all scheduled tokens — decode rows and prompt
chunks alike — into one ``[1, T]`` sequence with explicit position ids and runs the model once;
``worker.model.attention`` does the rest. Where the step's decode rows (or prompt chunks) share leading
blocks and it pays, the metadata marks the split for cascade attention (``worker.model.cascade``).

With ``cuda_graphs`` on, a pure-decode step takes the padded static path instead
(``worker.model.static_decode``: fixed buckets, static buffers, replayed CUDA graphs on a GPU,
the same path eagerly on CPU); mixed and prefill steps stay on this dynamic path. That path
reserves one block of the pool as its null block (padding rows write there): ``num_blocks`` is
then the pool's blocks less that one, the blocks requests can be given.

Both paths read one persistent ``BlockTable`` (a row per scheduled sequence, in step order: the
batch rows, then the prompt chunks not yet in it), synced incrementally at the start of each step:
host work per step is one identity check per row plus the blocks that changed, not a rebuild of
every row's table from lists.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Self

import torch

from worker.config import EngineConfig
from worker.model.attention import (
    METADATA_KWARG,
    DecodeRows,
    PromptChunk,
    StepMetadata,
    prepared_mask_sentinel,
    register_attention,
    resolve_backend,
)
from worker.model.block_table import BlockTable
from worker.model.cascade import cascade_pays, common_prefix_blocks, shared_chunks, shared_prefix
from worker.model.fusion import fuse_layers
from worker.model.gather import head_major
from worker.model.host_malloc import keep_freed_memory
from worker.model.loader import LoadedModel
from worker.model.packed_linear import pack_linears, packed_gemms, resolve_packed_weights
from worker.model.static_decode import CaptureReport, StaticDecode, resolve_mode
from worker.ops.staging import int64_tensor, stage, to_device

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 64  # EngineConfig's: the largest batch bucket of the padded decode path


@dataclass(frozen=True)
class ScheduledSeq:
    block_ids: Sequence[int]  # the request's block table (at least the blocks this step touches)
    token_ids: list[int]  # tokens to run this step (a prompt chunk, or the 1 last sampled token)
    start_pos: int  # how many tokens of this request are already in its KV blocks
    sample: bool  # True if this seq's last position produces logits this step
    # Logits of this many leading positions are returned too (prompt logprobs), after every sampled row.
    prompt_logits: int = 0


def decode_only(seqs: Sequence[ScheduledSeq]) -> bool:
    """Every seq runs one token and returns no prompt logits: a decode step. Packed weights run
    only here, so prompt logprobs and a prompt's KV stay torch's numbers bitwise (what an
    evaluation harness compares with transformers'); prefill chunks are mostly past PACKED_ROWS."""
    return all(len(s.token_ids) == 1 and not s.prompt_logits for s in seqs)


@dataclass(frozen=True)
class TokenFeed:
    """Input ids still on the device (async scheduling): the one token of step seq ``seqs[j]``
    is ``tokens[rows[j]]``, the last step's sampled token of that row (its scheduled id is a
    placeholder). A failed row's -1 is read as 0: its result is dropped when that step is read."""

    tokens: torch.Tensor  # [rows of the last step] int64, on the device
    seqs: list[int]
    rows: list[int]

    def write(self, ids: torch.Tensor, at: list[int]) -> None:
        """``ids[at[j]] = tokens[rows[j]]``: device ops only (indices staged without a sync)."""
        dev = ids.device
        fed = self.tokens.index_select(0, to_device(self.rows, torch.int64, dev)).clamp_min_(0)
        ids.index_copy_(0, to_device(at, torch.int64, dev), fed)


def kv_shape(loaded: LoadedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's attention (a shard's KV heads, for a shard)."""
    text = loaded.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if loaded.shard is not None:
        kv_heads = loaded.shard.kv_heads_per_rank
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return int(text.num_hidden_layers), int(kv_heads), int(head_dim)


def block_bytes(loaded: LoadedModel, block_size: int) -> int:
    """Bytes one block takes over all layers, keys and values."""
    layers, kv_heads, head_dim = kv_shape(loaded)
    return 2 * layers * block_size * kv_heads * head_dim * loaded.dtype.itemsize


def num_blocks_for(loaded: LoadedModel, block_size: int, *, kv_cache_bytes: int | None, default_tokens: int) -> int:
    """How many blocks the KV budget holds: ``kv_cache_bytes`` when given (on a GPU, the profiled
    budget of ``worker.model.profile`` unless the config sets one), else room for ``default_tokens``."""
    per_block = block_bytes(loaded, block_size)
    budget = -(-default_tokens // block_size) * per_block if kv_cache_bytes is None else kv_cache_bytes
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_bytes: {budget} bytes hold no KV block of {per_block} bytes")
    return int(blocks)


class ModelRunner:
    """Preallocated paged KV cache + one forward per step for any mix of decode rows and chunks.

    Side effect: switches ``loaded.model`` to the registered paged-KV attention; calls without
    the step metadata (``model.generate()``) still run transformers' SDPA.
    """

    @classmethod
    def for_config(cls, loaded: LoadedModel, config: EngineConfig, *, num_blocks: int, max_model_len: int) -> Self:
        """The runner an engine (or a tensor-parallel rank) builds: every option from ``config``,
        the one place they are mapped."""
        return cls(
            loaded,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=max_model_len,
            attention_backend=config.attention_backend,
            fused_layers=config.fused_layers,
            packed_weights=config.packed_weights,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
        )

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        fused_layers: bool = True,
        packed_weights: bool = False,
        cuda_graphs: bool | None = False,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    ) -> None:
        """``attention_backend``: ``EngineConfig.attention_backend``; refused here, at start-up,
        where the device cannot run it. ``fused_layers``: ``EngineConfig.fused_layers``.
        ``packed_weights``: ``EngineConfig.packed_weights`` (decode steps only: ``decode_only``).
        ``cuda_graphs``: ``EngineConfig.cuda_graphs`` (None = auto;
        the default False keeps helper runners, e.g. the profile run's, on the dynamic path), with
        batch buckets up to ``max_num_seqs``; on CUDA the graphs are captured here, once the KV
        pool exists. ``num_blocks``: the pool's blocks, the null block included."""
        self.attention_backend = resolve_backend(attention_backend, loaded.device, block_size)
        self.packed_weights = resolve_packed_weights(packed_weights, loaded.device, loaded.dtype)
        mode = resolve_mode(cuda_graphs, loaded.device, sharded=loaded.shard is not None)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if mode != "off" and num_blocks < 2:
            raise ValueError(
                f"cuda_graphs: the padded decode path reserves a null block; a KV pool of {num_blocks} block "
                "leaves none for requests"
            )
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        max_len = loaded.max_model_len if max_model_len is None else max_model_len
        if not 1 <= max_len <= loaded.max_model_len:
            raise ValueError(f"max_model_len must be in [1, {loaded.max_model_len}], got {max_model_len}")
        layers, kv_heads, head_dim = kv_shape(loaded)
        shape = (kv_heads, num_blocks, block_size, head_dim)
        # Zeros, not empty: masked positions get weight 0, and 0 * NaN garbage would still be NaN.
        self._k = tuple(torch.zeros(shape, dtype=loaded.dtype, device=loaded.device) for _ in range(layers))
        self._v = tuple(torch.zeros(shape, dtype=loaded.dtype, device=loaded.device) for _ in range(layers))
        self.kv_cache_bytes: int = sum(t.numel() * t.element_size() for t in self._k + self._v)
        self.pool_blocks = num_blocks  # physical blocks per layer, the null block included
        self.num_blocks = num_blocks - (mode != "off")  # the blocks requests can be given
        self.block_size = block_size
        self.max_model_len = max_len
        self.vocab_size = loaded.vocab_size
        self._model = loaded.model
        self._device = loaded.device
        if loaded.device.type == "cpu":
            keep_freed_memory()  # the process's malloc: a step's temporaries reused, not re-mapped
        self._model.set_attn_implementation(register_attention())
        if fused_layers:
            logger.info("fused layers: %s", fuse_layers(self._model, packed=self.packed_weights).describe())
        if self.packed_weights:
            logger.info("packed weights: %d more linears on MKL's packed GEMM", pack_linears(self._model))
        self._no_mask = prepared_mask_sentinel(loaded.device)
        self._workspace: dict[str, torch.Tensor] = {}
        cuda = loaded.device.type == "cuda"
        # The padded path's padding rows point at its null block; without it, block 0 pads (masked).
        null = self.num_blocks if mode != "off" else 0
        max_blocks = -(-max_len // block_size)
        self.block_table = BlockTable(max_num_seqs, max_blocks, null, num_valid=self.num_blocks, pin_memory=cuda)
        # The dynamic path's device copy of the table (on CPU the table itself is read).
        self._device_table: torch.Tensor | None = None
        # The host table is rewritten each step: not before the last step's copy out of it ran.
        self._copied = torch.cuda.Event() if cuda else None
        self.num_cascade_steps = 0  # steps whose decode rows attended a shared prefix once (cascade)
        self.num_cascade_chunk_steps = 0  # ... whose prompt chunks did
        self.static: StaticDecode | None = None
        self.capture_report: CaptureReport | None = None  # what start-up captured (graphs mode)
        if mode != "off":
            self.static = StaticDecode(
                self._model,
                self._k,
                self._v,
                mode=mode,
                max_num_seqs=max_num_seqs,
                block_size=block_size,
                max_model_len=max_len,
                table=self.block_table,  # its null block: the last, outside [0, num_blocks)
                copied=self._copied,
                no_mask=self._no_mask,
                workspace=self._workspace,
            )
            if mode == "graphs":
                self.capture_report = self.static.capture()
            else:
                logger.info("%s", self.static.describe())

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def healthy(self) -> bool:
        """Whether it can run a step (one process: always; a tensor-parallel group: every rank up)."""
        return True

    def rank_pids(self) -> list[int]:
        """The processes of the other ranks (none in one process)."""
        return []

    def close(self) -> None:
        """Nothing to release in one process (a tensor-parallel runner stops its ranks)."""

    # ------------------------------------------------------------------ step

    def _check(self, seqs: Sequence[ScheduledSeq]) -> list[int]:
        """Validate the step; return each seq's blocks in use at its end. O(seqs + blocks written):
        the range of every block id is checked as it enters the ``BlockTable``."""
        written: set[int] = set()
        bs = self.block_size
        used: list[int] = []
        for i, s in enumerate(seqs):
            if not s.token_ids:
                raise ValueError(f"seq {i}: no tokens scheduled")
            end = s.start_pos + len(s.token_ids)
            if s.start_pos < 0 or end > self.max_model_len:
                raise ValueError(f"seq {i}: {end} tokens exceed max_model_len {self.max_model_len}")
            if len(s.block_ids) * bs < end:
                raise ValueError(f"seq {i}: {len(s.block_ids)} blocks cannot hold {end} tokens")
            n = -(-end // bs)
            for b in s.block_ids[s.start_pos // bs : n]:
                if b in written:
                    raise ValueError(f"seq {i}: block {b} is written by two sequences in one step")
                written.add(b)
            used.append(n)
        return used

    def _sync_table(self, seqs: Sequence[ScheduledSeq], used: list[int]) -> None:
        """Bring the persistent block table in step with this step's sequences (row i = seqs[i])."""
        if self._copied is not None:
            self._copied.synchronize()  # done: the copies open the last step, which the device has begun
        self.block_table.ensure_rows(len(seqs))
        self.block_table.sync([s.block_ids for s in seqs], used)

    def _table_on_device(self, rows: int) -> torch.Tensor:
        """Rows ``[:rows]`` of the block table where the forward reads them (int32)."""
        host = self.block_table.table
        if self._copied is None:
            return host[:rows]
        dev = self._device_table
        if dev is None or dev.shape[0] < host.shape[0]:
            dev = self._device_table = torch.empty(host.shape, dtype=host.dtype, device=self._device)
        dev[:rows].copy_(host[:rows], non_blocking=True)
        self._copied.record()
        return dev[:rows]

    def _metadata(
        self, seqs: Sequence[ScheduledSeq], used: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepMetadata]:
        """Every index tensor of the step: the per-token ones from Python lists (one host-to-device
        copy), the block tables as rows of the persistent table."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        extra: list[int] = []
        dec_index: list[int] = []
        dec_lens: list[int] = []
        dec_rows: list[int] = []
        chunk_args: list[tuple[int, int, int, Sequence[int]]] = []  # (flattened start, tokens, KV start, blocks)
        chunk_rows: list[int] = []
        for row, s in enumerate(seqs):
            n, start = len(s.token_ids), len(ids)
            end = s.start_pos + n
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, end))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(s.start_pos, end))
            if s.sample:
                keep.append(start + n - 1)
            extra.extend(range(start, start + s.prompt_logits))
            if n == 1:
                dec_index.append(start)
                dec_lens.append(end)
                dec_rows.append(row)
            else:
                chunk_args.append((start, n, s.start_pos, table[: used[row]]))
                chunk_rows.append(row)
        keep += extra
        width = max((used[r] for r in dec_rows), default=0)
        leading = dec_rows == list(range(len(dec_rows)))  # the decode rows are the table's first rows
        shared = self._shared_blocks(dec_rows, leading, dec_lens, width)
        lists = (ids, pos, slots, keep, dec_index, dec_lens, [] if leading else dec_rows)
        flat = int64_tensor(list(chain.from_iterable(lists)))
        flat = stage(flat, torch.int64, self._device, pin=self._copied is not None)  # pinned on CUDA: no sync
        t_ids, t_pos, t_slots, t_keep, t_dec_index, t_dec_lens, t_dec_rows = flat.split([len(part) for part in lists])
        tables = self._table_on_device(len(seqs))

        kvh, nb = self._k[0].shape[0], self.pool_blocks
        decode = None
        if dec_index:
            rows = tables[: len(dec_rows)] if leading else tables.index_select(0, t_dec_rows)
            dec_table = rows[:, :width].long()
            cascade = None
            if shared:
                self.num_cascade_steps += 1
                cascade = shared_prefix(dec_table, t_dec_lens, max(dec_lens), shared, self.block_size, nb, kvh)
            heads = head_major(dec_table.reshape(-1), kvh, nb)
            decode = DecodeRows(t_dec_index, dec_table, heads, t_dec_lens, max(dec_lens), cascade)
        chunks: list[PromptChunk] = []
        for (tok, n, start, table_ids), row in zip(chunk_args, chunk_rows):
            blocks = tables[row, : len(table_ids)].long()
            chunks.append(PromptChunk(tok, n, start, blocks, head_major(blocks, kvh, nb)))
        cascade_chunks = None
        if len(chunk_args) > 1:
            cascade_chunks = shared_chunks(chunk_args, self.block_size, nb, kvh, self._device)
            self.num_cascade_chunk_steps += cascade_chunks is not None
        meta = StepMetadata(
            self._k, self._v, t_slots, decode, tuple(chunks), self._workspace, cascade_chunks, self.attention_backend
        )
        return t_ids, t_pos, t_keep, meta

    def _shared_blocks(self, rows: list[int], leading: bool, lengths: list[int], width: int) -> int:
        """Leading blocks shared by every decode row, or 0 where cascade attention would not pay.

        Decided on the host table, before the step's copies to the device (no device sync).
        """
        if not cascade_pays(len(lengths), width * self.block_size):
            return 0
        host = self.block_table.table
        table = host[: len(rows), :width] if leading else host[rows, :width]
        shared = common_prefix_blocks(table, torch.tensor(lengths), self.block_size)
        return shared if shared and cascade_pays(len(lengths), shared * self.block_size) else 0

    def execute(self, seqs: Sequence[ScheduledSeq], feed: TokenFeed | None = None) -> torch.Tensor:
        """Run one step; return raw logits [num sampled seqs, vocab] (model dtype), in seqs order,
        then the ``prompt_logits`` rows of each seq, in seqs order. ``feed``: the one-token seqs
        whose token is still on the device (async scheduling)."""
        used = self._check(seqs)
        with torch.inference_mode(), packed_gemms(self.packed_weights and decode_only(seqs)):
            if not seqs:
                return torch.empty((0, self.vocab_size), dtype=self._k[0].dtype, device=self._device)
            self._sync_table(seqs, used)
            if self.static is not None and self.static.fits(seqs):
                return self.static.run(seqs, used, feed)
            ids, pos, keep, meta = self._metadata(seqs, used)
            if feed is not None:
                starts = list(accumulate((len(s.token_ids) for s in seqs), initial=0))
                feed.write(ids, [starts[i] for i in feed.seqs])
            out = self._model(
                input_ids=ids[None],
                attention_mask=self._no_mask,
                position_ids=pos[None],
                use_cache=False,
                logits_to_keep=keep,
                **{METADATA_KWARG: meta},
            )
        return out.logits[0]
