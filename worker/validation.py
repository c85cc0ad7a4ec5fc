"""Request validation shared by the engine and the serving ingress (which has no model loaded).

Standard rules (docs/sampling.md "Validation and ranges", in SamplingParams) + vocabulary/context checks + every loaded
processor's ``validate_params``; each failure is a ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.logits_processor.registry import LogitsProcessors
from worker.logits_processor.structured_grammar import compiler_for
from worker.sampling_params import SamplingParams, check_unicode

Prompt = str | list[int]


@dataclass(frozen=True)
class RequestValidator:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    processors: LogitsProcessors

    def validate(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked (ValueError naming the field), returned as the engine takes them
        (-1 logprobs resolved to the vocabulary)."""
        params.validate_for_model(self.vocab_size, self.max_logprobs)
        params = params.resolved(self.vocab_size)
        self.processors.validate_params(params)
        so = params.structured_outputs
        if so is not None:  # compiled (or found in the cache) here, before admission, off the step
            so.compiled = compiler_for(self.tokenizer, self.vocab_size).compile(so)
        return params

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.check_length(self.encode(prompt))

    def encode(self, prompt: Prompt, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """A text prompt's token ids (with the tokenizer's special tokens unless told not to), or
        a token-id prompt checked against the vocabulary; the length is not checked yet (the
        front end may truncate first). Errors name ``field``."""
        if isinstance(prompt, str):
            check_unicode(field, prompt)
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"{field}: token ids must be integers in [0, {self.vocab_size})")
        return ids

    def check_length(self, ids: list[int]) -> list[int]:
        """``ids`` when they are a prompt that leaves room to generate."""
        if not ids:
            raise ValueError("prompt: must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate (max_model_len={self.max_model_len})"
            )
        return ids
