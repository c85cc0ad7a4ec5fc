"""The cheap prompt-length bound (cluster.prompt_bound), without a cluster: which tokenizers get
one, and that it is a true lower bound (tokens >= characters / C) against the tokenizer itself,
on the tiny model's tokenizer and on tokenizers of each kind built here."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from cluster.prompt_bound import max_chars_per_token, max_prompt_chars

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog " * 20,
    "ünïcødé 漢字 🙂 naïve café — «quotes» " * 30,
    "    indented\n\tcode();\n" * 40,
]


def _trained(model, trainer, normalizer=None, pre_tokenizer=None) -> Tokenizer:
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@functools.cache
def tokenizers_with_a_bound() -> dict[str, Tokenizer]:
    return {
        "byte-level BPE": _trained(
            models.BPE(),
            trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
            pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False),
        ),
        "sentencepiece-like BPE (byte fallback)": _trained(
            models.BPE(byte_fallback=True),
            trainers.BpeTrainer(vocab_size=400),
            normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        ),
        "BPE, unknown per character, isolated splits": _trained(
            models.BPE(unk_token="[UNK]"),
            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]),
            pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.Digits()]),
        ),
    }


def test_the_tiny_models_tokenizer_gets_a_bound(tiny_model_dir):
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(tiny_model_dir).backend_tokenizer
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)))
    assert max_chars_per_token(backend) == longest
    assert max_prompt_chars(longest, 512) == 511 * longest and max_prompt_chars(None, 512) is None


@pytest.mark.parametrize(
    ("name", "witness", "build"),
    [
        # WordPiece: a word past max_input_chars_per_word is one [UNK], whatever its length.
        (
            "WordPiece",
            "x" * 1000,
            lambda: _trained(
                models.WordPiece(unk_token="[UNK]"),
                trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]),
                pre_tokenizer=pre_tokenizers.Whitespace(),
            ),
        ),
        # Whitespace splitting drops the whitespace: a megabyte of spaces is no token at all.
        (
            "Whitespace pre-tokenizer",
            " " * 1000 + "a",
            lambda: _trained(
                models.BPE(unk_token="[UNK]"),
                trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]),
                pre_tokenizer=pre_tokenizers.Whitespace(),
            ),
        ),
        (
            "Split removing its delimiter",
            " " * 1000,
            lambda: _trained(
                models.BPE(byte_fallback=True),
                trainers.BpeTrainer(vocab_size=300),
                pre_tokenizer=pre_tokenizers.Split(" ", "removed"),
            ),
        ),
        (
            "stripping normalizer",
            " " * 5000 + "a",
            lambda: _trained(
                models.BPE(byte_fallback=True),
                trainers.BpeTrainer(vocab_size=300),
                normalizer=normalizers.Sequence([normalizers.Strip(), normalizers.NFC()]),
            ),
        ),
        (
            "fused unknowns",
            "€" * 5000,
            lambda: _trained(
                models.BPE(unk_token="[UNK]", fuse_unk=True),
                trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]),
            ),
        ),
    ],
)
def test_tokenizers_that_may_shrink_text_get_none(name, witness, build):
    """No bound, rightly: for each, a text with fewer tokens than characters / longest entry."""
    tok = build()
    assert max_chars_per_token(tok) is None, name
    longest = max(map(len, tok.get_vocab(with_added_tokens=True)))
    assert len(tok.encode(witness).ids) * longest < len(witness), name


def test_whitespace_stripping_added_tokens_or_truncation_get_none():
    from tokenizers import AddedToken

    tok = tokenizers_with_a_bound()["byte-level BPE"]
    stripping = Tokenizer.from_str(tok.to_str())
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert max_chars_per_token(stripping) is None
    truncating = Tokenizer.from_str(tok.to_str())
    truncating.enable_truncation(16)
    assert max_chars_per_token(truncating) is None


_text = st.text(
    st.sampled_from(list("ab cdé\n\t漢🙂xyz  .,;0123")) | st.characters(exclude_categories=("Cs",)), max_size=300
)  # no lone surrogates: the ingress refuses them before tokenizing


@pytest.mark.parametrize("name", list(tokenizers_with_a_bound()))
@settings(max_examples=150, deadline=None)
@given(text=_text)
def test_the_bound_is_a_lower_bound_on_tokens(name, text):
    tok = tokenizers_with_a_bound()[name]
    bound = max_chars_per_token(tok)
    assert bound is not None
    assert len(tok.encode(text).ids) * bound >= len(text)


@settings(max_examples=150, deadline=None)
@given(text=_text)
def test_the_bound_holds_for_the_tiny_tokenizer(tiny_model_dir, text):
    tok = _tiny(str(tiny_model_dir))
    bound = max_chars_per_token(tok.backend_tokenizer)
    assert len(tok.encode(text, add_special_tokens=False)) * bound >= len(text)


@functools.cache
def _tiny(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
