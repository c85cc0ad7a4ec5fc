"""A prompt too long for the context, refused from its length alone, before it is tokenized.

Tokenizing a 1 MiB prompt takes seconds of CPU, only to learn it does not fit. When every token
of a tokenizer stands for at most C characters of the input, a text of N characters has at least
N / C tokens, so one longer than (max_model_len - 1) × C characters cannot fit. That holds when
nothing on the way from text to tokens drops or merges characters; `max_chars_per_token` reads
the tokenizer's definition (its tokenizer.json) and gives C only then:

- the model is BPE that loses no character: byte-level (every byte is in the vocabulary), byte
  fallback, or an unknown token per unknown character (not fused);
- the normalizer only adds or keeps characters (NFD/NFKD, lowercasing, prepending, replacing a
  string by one at least as long); the pre-tokenizer removes none (no whitespace splitting);
- no added token strips the whitespace beside it (lstrip/rstrip), and no truncation is set.

Otherwise (WordPiece's one [UNK] per long word, a stripping normalizer, ...) there is no bound
and the prompt is tokenized; the front end does that off the event loop either way.
C is the longest vocabulary entry, added tokens included: a byte-level entry's length is its
byte count (bytes >= characters), a byte-fallback entry (``<0xE3>``) overstates its one byte.
"""

from __future__ import annotations

import json
from typing import Any

_SAFE_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


def _parts(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer as its list of steps (a Sequence flattened)."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        key = "normalizers" if "normalizers" in component else "pretokenizers"
        return [p for c in component.get(key, []) for p in _parts(c)]
    return [component]


def _keeps_length(step: dict[str, Any], safe: set[str]) -> bool:
    kind = step.get("type")
    if kind == "Replace":  # a plain string replaced by one at least as long
        pattern = step.get("pattern", {}).get("String")
        return isinstance(pattern, str) and 0 < len(pattern) <= len(step.get("content", ""))
    if step.get("behavior") == "Removed":  # Split / Punctuation dropping what they split on
        return False
    return kind in safe


def _model_keeps_characters(model: dict[str, Any], byte_level: bool, vocab: dict[str, int]) -> bool:
    if model.get("type") != "BPE":
        return False
    if byte_level:  # every byte has its entry (a byte-level vocabulary starts from all 256)
        from tokenizers.pre_tokenizers import ByteLevel

        if all(c in vocab for c in ByteLevel.alphabet()):
            return True
    return bool(model.get("byte_fallback")) or (model.get("unk_token") is not None and not model.get("fuse_unk"))


def max_chars_per_token(backend: Any) -> int | None:
    """C for a `tokenizers.Tokenizer` (a fast tokenizer's ``backend_tokenizer``), or None when
    its tokens may stand for unboundedly many characters (see the module docstring)."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot describe itself gets no bound
        return None
    normalizers, pre_tokenizers = _parts(spec.get("normalizer")), _parts(spec.get("pre_tokenizer"))
    if spec.get("truncation") is not None:
        return None
    if not all(_keeps_length(s, _SAFE_NORMALIZERS) for s in normalizers):
        return None
    if not all(_keeps_length(s, _SAFE_PRE_TOKENIZERS) for s in pre_tokenizers):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    byte_level = any(s.get("type") == "ByteLevel" for s in normalizers + pre_tokenizers)
    if not _model_keeps_characters(spec.get("model", {}), byte_level, vocab):
        return None
    return max(map(len, vocab), default=0) or None


def max_prompt_chars(chars_per_token: int | None, max_model_len: int) -> int | None:
    """The longest text that might still fit: a prompt needs fewer than max_model_len tokens."""
    return None if chars_per_token is None else (max_model_len - 1) * chars_per_token
