"""ModelRunner: owns the KV slots and runs one flattened forward per engine step.

Requests point to KV slots (the runner hands them out, the engine remembers a request's slot),
so moving or swapping rows of the persistent batch copies no KV. Each step flattens all
scheduled tokens — decode rows and prompt chunks alike — into one ``[1, T]`` sequence with
explicit position ids and runs the model once; ``worker.attention`` does the rest.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.attention import (
    METADATA_KWARG,
    DecodeRows,
    PromptChunk,
    StepMetadata,
    prepared_mask_sentinel,
    register_attention,
)
from worker.models import LoadedModel


@dataclass(frozen=True)
class ScheduledSeq:
    slot: int  # KV slot of the request
    token_ids: list[int]  # tokens to run this step (a prompt chunk, or the 1 last sampled token)
    start_pos: int  # how many tokens of this request are already in the KV slot
    sample: bool  # True if this seq's last position produces logits this step


class ModelRunner:
    """Preallocated slot KV cache + one forward per step for any mix of decode rows and chunks.

    Side effect: switches ``loaded.model`` to the registered slot-KV attention; calls without
    the step metadata (``model.generate()``) still run transformers' SDPA.
    """

    def __init__(self, loaded: LoadedModel, *, max_num_seqs: int, max_model_len: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        max_len = loaded.max_model_len if max_model_len is None else max_model_len
        if not 1 <= max_len <= loaded.max_model_len:
            raise ValueError(f"max_model_len must be in [1, {loaded.max_model_len}], got {max_model_len}")
        text = loaded.config.get_text_config()
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shape = (max_num_seqs, kv_heads, max_len, head_dim)
        # Zeros, not empty: masked positions get weight 0, and 0 * NaN garbage would still be NaN.
        kw = {"dtype": loaded.dtype, "device": loaded.device}
        self._k = tuple(torch.zeros(shape, **kw) for _ in range(text.num_hidden_layers))
        self._v = tuple(torch.zeros(shape, **kw) for _ in range(text.num_hidden_layers))
        self.kv_cache_bytes: int = sum(t.numel() * t.element_size() for t in self._k + self._v)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_len
        self.vocab_size = loaded.vocab_size
        self._model = loaded.model
        self._device = loaded.device
        self._model.set_attn_implementation(register_attention())
        self._no_mask = prepared_mask_sentinel(loaded.device)
        self._free = list(range(max_num_seqs))  # a min-heap: the lowest free slot goes first
        self._lengths: list[int | None] = [None] * max_num_seqs  # tokens in the slot; None = free

    # ------------------------------------------------------------------ slots

    def allocate_slot(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free KV slot (all {self.max_num_seqs} in use)")
        slot = heapq.heappop(self._free)
        self._lengths[slot] = 0
        return slot

    def free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_num_seqs or self._lengths[slot] is None:
            raise ValueError(f"slot {slot} is not allocated")
        self._lengths[slot] = None
        heapq.heappush(self._free, slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------ step

    def _check(self, seqs: Sequence[ScheduledSeq]) -> None:
        seen: set[int] = set()
        for s in seqs:
            if not 0 <= s.slot < self.max_num_seqs or self._lengths[s.slot] is None:
                raise ValueError(f"slot {s.slot} is not allocated")
            if s.slot in seen:
                raise ValueError(f"slot {s.slot} scheduled twice in one step")
            seen.add(s.slot)
            if not s.token_ids:
                raise ValueError(f"slot {s.slot}: no tokens scheduled")
            if not 0 <= s.start_pos <= self._lengths[s.slot]:
                raise ValueError(
                    f"slot {s.slot}: start_pos {s.start_pos} but the slot holds {self._lengths[s.slot]} tokens"
                )
            if s.start_pos + len(s.token_ids) > self.max_model_len:
                raise ValueError(
                    f"slot {s.slot}: {s.start_pos + len(s.token_ids)} tokens exceed max_model_len {self.max_model_len}"
                )

    def _metadata(self, seqs: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepMetadata]:
        """Build every index tensor of the step from Python lists, with one host-to-device copy."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        dec_index: list[int] = []
        dec_slots: list[int] = []
        dec_lens: list[int] = []
        chunk_args: list[tuple[int, int, int, int]] = []
        for s in seqs:
            n, start = len(s.token_ids), len(ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + n))
            slots.extend([s.slot] * n)
            if s.sample:
                keep.append(start + n - 1)
            if n == 1:
                dec_index.append(start)
                dec_slots.append(s.slot)
                dec_lens.append(s.start_pos + 1)
            else:
                chunk_args.append((start, n, s.slot, s.start_pos))
        total = len(ids)
        flat = torch.tensor(ids + pos + slots + keep + dec_index + dec_slots + dec_lens, dtype=torch.long)
        flat = flat.to(self._device, non_blocking=True)
        sizes = [total, total, total, len(keep), len(dec_index), len(dec_index), len(dec_index)]
        t_ids, t_pos, t_slots, t_keep, t_dec_index, t_dec_slots, t_dec_lens = flat.split(sizes)

        decode = None
        if dec_index:
            max_len = max(dec_lens)
            visible = torch.arange(max_len, device=self._device)[None, :] < t_dec_lens[:, None]
            decode = DecodeRows(t_dec_index, t_dec_slots, visible[:, None, None, :], max_len)
        chunks = tuple(
            PromptChunk(tok, n, slot, start, self._causal_mask(start, n)) for tok, n, slot, start in chunk_args
        )
        meta = StepMetadata(self._k, self._v, t_slots, t_pos, decode, chunks)
        return t_ids, t_pos, t_keep, meta

    def _causal_mask(self, start: int, n: int) -> torch.Tensor:
        keys = torch.arange(start + n, device=self._device)
        queries = torch.arange(start, start + n, device=self._device)
        return keys[None, :] <= queries[:, None]

    def execute(self, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Run one step; return raw logits [num sampled seqs, vocab] (model dtype), in seqs order."""
        self._check(seqs)
        with torch.inference_mode():
            if not seqs:
                return torch.empty((0, self.vocab_size), dtype=self._k[0].dtype, device=self._device)
            ids, pos, keep, meta = self._metadata(seqs)
            out = self._model(
                input_ids=ids[None],
                attention_mask=self._no_mask,
                position_ids=pos[None],
                use_cache=False,
                logits_to_keep=keep,
                **{METADATA_KWARG: meta},
            )
        for s in seqs:
            self._lengths[s.slot] = s.start_pos + len(s.token_ids)
        return out.logits[0]
