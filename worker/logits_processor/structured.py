"""StructuredOutputsLogitsProcessor: rows with ``structured_outputs`` keep only grammar-legal tokens.

Built in, step 5 (not argmax-invariant: the mask can remove a row's best token). Per row it
holds a grammar matcher (RowStates, so adds / removes / condense moves / swaps carry it with its
row) and the request's live output list; each ``apply`` first feeds the matcher the tokens
appended since the last step, then fills one int32 bitmask for the whole batch (constrained rows
from their matchers, every other row all ones) and applies it in one vectorised ``masked_fill_``.
EOS is allowed only where the grammar accepts the text so far; a request that reaches
``max_tokens`` mid-structure finishes with ``length`` like any other.

Compiling is not done here: ``RequestValidator.validate`` compiles (or finds in its cache) each
constraint before admission and attaches it to ``params.structured_outputs.compiled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.logits_processor.state import RowStates
from worker.logits_processor.structured_grammar import GrammarMatcher, MaskFiller, bitmask_words
from worker.ops.staging import DoubleBuffer
from worker.sampling_params import SamplingParams

_BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(rows, words)`` int32 bitmask -> ``(rows, vocab_size)`` bool, bit ``t % 32`` of word ``t // 32``."""
    shifts = torch.arange(_BITS, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Every token whose bit is clear becomes -inf, in place, in one pass over the batch.

    Plain torch on any device. (xgrammar 0.2.8's own CPU kernel corrupts the heap when the
    vocabulary is narrower than one 32-bit word, so it is not used.)
    """
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    return logits.masked_fill_(allowed.logical_not_(), float("-inf"))


@dataclass
class _Row:
    matcher: GrammarMatcher
    output: list[int]  # live: the engine appends every sampled token
    consumed: int = 0

    def sync(self) -> None:
        """Feed the matcher every token sampled since the last call."""
        out = self.output
        while self.consumed < len(out):
            self.matcher.accept(out[self.consumed])
            self.consumed += 1


class StructuredOutputsLogitsProcessor(LogitsProcessor):
    """Step 5: JSON schema / JSON object / regex / choice / grammar constraints, per row."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.is_pin_memory = is_pin_memory
        self.states: RowStates[_Row] = RowStates(self._state)
        self._filler = MaskFiller()
        # The host bitmask of a step reaches the device by a non-blocking copy: the next step
        # fills the other half of the pair, and waits for this copy before reusing this one.
        self._bitmask = DoubleBuffer(torch.int32, self.device, is_pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False

    def _state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        so = params.structured_outputs
        if so is None:
            return None
        if so.compiled is None:
            raise ValueError(f"{so.field_name}: not compiled (requests must pass RequestValidator.validate)")
        return _Row(so.compiled.matcher(), output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.states.update(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        items = list(self.states.items())
        for _, row in items:
            row.sync()
        bitmask = self._bitmask.host(logits.shape[0], bitmask_words(logits.shape[1]))
        bitmask.fill_(-1)  # unconstrained rows: every token allowed, so masked_fill_ leaves them as they are
        self._filler.fill([r.matcher for _, r in items], [i for i, _ in items], bitmask)
        return apply_token_bitmask_(logits, self._bitmask.to_device(bitmask))
