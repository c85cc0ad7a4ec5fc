"""No-repeat-ngram (transformers' ``NoRepeatNGramLogitsProcessor``): never complete a seen n-gram.

Over the request's prompt + output: when the last ``n - 1`` tokens equal the first ``n - 1`` of
an n-gram already in the text, that n-gram's last token is banned (-inf); nothing is banned
while ``len(text) + 1 < n``. Each row keeps a prefix -> next-tokens index, extended by the new
tokens only (the output list is live), so a step costs O(new tokens), not O(length). Not
argmax-invariant; it acts on greedy rows too (its classic use), so all-greedy batches run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import Field

from worker.logits_processor.library.base import NEG_INF, LibraryProcessor
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams


class NoRepeatNgramArgs(ExtraArgs):
    no_repeat_ngram_size: int = Field(ge=0, le=1024, description="n of the n-grams never repeated; 0 = off.")


@dataclass
class _Row:
    n: int
    prompt: list[int]
    output: list[int]  # live
    seen: dict[tuple[int, ...], set[int]] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `seen`

    def token(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    def banned(self) -> set[int]:
        length = len(self.prompt) + len(self.output)
        for end in range(max(self.indexed, self.n - 1), length):  # index the new n-grams
            gram = tuple(self.token(i) for i in range(end - self.n + 1, end + 1))
            self.seen.setdefault(gram[:-1], set()).add(gram[-1])
        self.indexed = max(self.indexed, length)
        if length + 1 < self.n:
            return set()
        return self.seen.get(tuple(self.token(i) for i in range(length - self.n + 1, length)), set())


class NoRepeatNgramLogitsProcessor(LibraryProcessor[_Row, NoRepeatNgramArgs]):
    """``extra_args={"no_repeat_ngram_size": 3}``."""

    extra_args_model = NoRepeatNgramArgs
    acts_on_greedy = True

    def _row_state(
        self, args: NoRepeatNgramArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _Row | None:
        n = int(args.no_repeat_ngram_size)
        return _Row(n, list(prompt_ids or []), output_ids) if n > 0 else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        rows: list[int] = []
        ids: list[int] = []
        for row, s in self.states.items():
            banned = sorted(t for t in s.banned() if t < logits.shape[1])
            rows += [row] * len(banned)
            ids += banned
        if rows:
            logits[self._stage(rows, torch.int64), self._stage(ids, torch.int64)] = NEG_INF
        return logits

    def is_argmax_invariant(self) -> bool:
        return False
