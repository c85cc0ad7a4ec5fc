"""Incremental detokenization: multi-byte characters split across tokens, stop strings, hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.model_fixtures import tiny_loaded
from worker.detokenizer import IncrementalDetokenizer, rust_tokenizer


def stream(text: str, stop: list[str] | None = None) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    tok = tiny_loaded().tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(rust_tokenizer(tok), tok.encode("prompt:", add_special_tokens=False), stop=stop)
    pieces, hit = [], None
    for i in ids:
        hit = d.update(i)
        pieces.append(d.take_delta(finished=hit is not None))
        if hit is not None:
            break
    else:
        pieces.append(d.take_delta(finished=True))
    return pieces, d, hit


@pytest.mark.parametrize("text", ["héllo wörld", "世界 and 🙂🙂 ok", "naïve café — “quotes”"])
def test_multibyte_characters_never_come_out_half(text):
    tok = tiny_loaded().tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "byte-level BPE must split these characters over several tokens"
    pieces, d, _ = stream(text)
    assert "".join(pieces) == text == d.text
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_joined_deltas_equal_the_full_decode(text):
    """The stream skips special tokens (the detokenizer's default), so does the reference: a
    text such as "<|bos|>" encodes to the special token itself."""
    tok = tiny_loaded().tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    pieces, _, _ = stream(text)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_is_cut_and_never_streamed():
    pieces, d, hit = stream("alpha beta STOP gamma", stop=["STOP"])
    assert hit == "STOP"
    assert "".join(pieces) == d.text == "alpha beta "
    assert all("S" not in p for p in pieces), "a possible stop prefix is held back while streaming"
