"""Incremental detokenization with stop strings, correct across multi-byte characters.

Built on ``tokenizers.decoders.DecodeStream`` seeded with the tail of the prompt (so the first
output token gets the spacing it would have in the full text). Stop strings are matched on the
detokenized text and excluded from the output; while a request runs, the last
``len(longest stop) - 1`` characters are held back from streaming, since they could still turn
into the start of a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Enough prompt context for a byte-level or sentencepiece decoder to space the first token.
_PROMPT_CONTEXT_TOKENS = 8


def rust_tokenizer(tokenizer: object) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; logitpool needs one")
    return backend


class IncrementalDetokenizer:
    def __init__(
        self,
        backend: Tokenizer,
        prompt_token_ids: list[int],
        *,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = backend
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self._stop = list(stop or [])
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._emitted = 0

    def update(self, token_id: int, check_stop: bool = True) -> str | None:
        """Feed one token; return the stop string it completed, if any (the text is cut before it).

        ``check_stop`` is False while the request is still under ``min_tokens``.
        """
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        if not self._stop or not check_stop:
            return None
        best: tuple[int, str] | None = None
        for s in self._stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def take_delta(self, finished: bool) -> str:
        """The text not yet handed out, holding back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def decode_token(self, token_id: int) -> str:
        return self._backend.decode([token_id], skip_special_tokens=False)
