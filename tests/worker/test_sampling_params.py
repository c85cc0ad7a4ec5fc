"""SamplingParams validation (docs/sampling.md "Validation and ranges"): each rule names the field and the bad value."""

from __future__ import annotations

from typing import Any

import pytest

from worker.sampling_params import SamplingParams

NAN, INF = float("nan"), float("inf")

# (kwargs, field named first in the message, the offending value as repr'd in the message)
INVALID: list[tuple[dict[str, Any], str, Any]] = [
    ({"n": 0}, "n", 0),
    ({"n": 1.0}, "n", 1.0),
    ({"temperature": -0.1}, "temperature", -0.1),
    ({"temperature": 2.01}, "temperature", 2.01),
    ({"temperature": NAN}, "temperature", NAN),
    ({"temperature": INF}, "temperature", INF),
    ({"temperature": "1"}, "temperature", "1"),
    ({"top_p": 0.0}, "top_p", 0.0),
    ({"top_p": 1.0001}, "top_p", 1.0001),
    ({"top_p": -0.5}, "top_p", -0.5),
    ({"top_k": -2}, "top_k", -2),
    ({"top_k": 2.0}, "top_k", 2.0),
    ({"top_k": True}, "top_k", True),
    ({"min_p": -0.01}, "min_p", -0.01),
    ({"min_p": 1.01}, "min_p", 1.01),
    ({"presence_penalty": -2.01}, "presence_penalty", -2.01),
    ({"presence_penalty": 2.01}, "presence_penalty", 2.01),
    ({"frequency_penalty": -2.01}, "frequency_penalty", -2.01),
    ({"frequency_penalty": 2.01}, "frequency_penalty", 2.01),
    ({"repetition_penalty": 0.0}, "repetition_penalty", 0.0),
    ({"repetition_penalty": -1.0}, "repetition_penalty", -1.0),
    ({"repetition_penalty": INF}, "repetition_penalty", INF),
    ({"repetition_penalty": NAN}, "repetition_penalty", NAN),
    ({"max_tokens": 0}, "max_tokens", 0),
    ({"max_tokens": -3}, "max_tokens", -3),
    ({"min_tokens": -1}, "min_tokens", -1),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens", 17),
    ({"seed": 1.5}, "seed", 1.5),
    ({"seed": "7"}, "seed", "7"),
    ({"allowed_token_ids": []}, "allowed_token_ids", []),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids", -1),
    ({"stop": [""]}, "stop", ""),
    ({"stop": ""}, "stop", ""),
    ({"bad_words": [""]}, "bad_words", ""),
    ({"bad_words": ["   "]}, "bad_words", "   "),
    ({"stop_token_ids": [-1]}, "stop_token_ids", -1),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", -1),
    ({"logit_bias": {1: INF}}, "logit_bias", INF),
    ({"logit_bias": {1: NAN}}, "logit_bias", NAN),
    ({"logit_bias": {"x": 1.0}}, "logit_bias", "x"),
    ({"logprobs": -2}, "logprobs", -2),
    ({"prompt_logprobs": -2}, "prompt_logprobs", -2),
    ({"logprobs_mode": "final"}, "logprobs_mode", "final"),
    ({"extra_args": [1, 2]}, "extra_args", [1, 2]),
]


@pytest.mark.parametrize(("kwargs", "field", "value"), INVALID, ids=[f"{f}={v!r}" for _, f, v in INVALID])
def test_invalid_value_is_rejected_naming_field_and_value(kwargs: dict[str, Any], field: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{field}:"), msg
    assert repr(value) in msg, msg


VALID: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 2.0},
    {"temperature": 1},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"top_k": 0},
    {"top_k": -1},
    {"top_k": 1},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"repetition_penalty": 1e-6},
    {"max_tokens": 1},
    {"min_tokens": 16, "max_tokens": 16},
    {"seed": 0},
    {"seed": -5},
    {"logprobs": 0},
    {"allowed_token_ids": [0]},
    {"logit_bias": {0: -100.0, 5: 100}},
    {"stop": "x"},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k) for k in VALID])
def test_edge_values_are_accepted(kwargs: dict[str, Any]) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name == "stop":
            assert p.stop == [value]
        elif name != "logit_bias":
            assert getattr(p, name) == value


def test_empty_extra_args_mean_none() -> None:
    """vLLM-style validate_params (`params.extra_args and ...`) must see None, not {}."""
    assert SamplingParams(extra_args={}).extra_args is None
    assert SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}


def test_logit_bias_string_keys_become_token_ids() -> None:
    assert SamplingParams(logit_bias={"5": 1.5}).logit_bias == {5: 1.5}


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.1).uses_penalties
    assert SamplingParams(frequency_penalty=-0.1).uses_penalties


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"stop_token_ids": [3, 10]}, "stop_token_ids", 10),
        ({"allowed_token_ids": [10]}, "allowed_token_ids", 10),
        ({"logit_bias": {12: 1.0}}, "logit_bias", 12),
        ({"logprobs": 21}, "logprobs", 21),
    ],
)
def test_validate_for_model_rejects(kwargs: dict[str, Any], field: str, value: int) -> None:
    p = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as info:
        p.validate_for_model(vocab_size=10)
    msg = str(info.value)
    assert msg.startswith(f"{field}:") and repr(value) in msg, msg


def test_validate_for_model_accepts_the_last_token_and_the_cap() -> None:
    SamplingParams(stop_token_ids=[9], allowed_token_ids=[0, 9], logit_bias={9: 1.0}, logprobs=20).validate_for_model(
        vocab_size=10
    )
    SamplingParams(logprobs=5).validate_for_model(vocab_size=10, max_logprobs=5)
    with pytest.raises(ValueError, match=r"^logprobs: must be <= 5, got 6"):
        SamplingParams(logprobs=6).validate_for_model(vocab_size=10, max_logprobs=5)


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_update_from_tokenizer_keeps_both_word_forms_and_eos() -> None:
    p = SamplingParams(bad_words=["ab"], stop_token_ids=[3])
    p.update_from_tokenizer(_Tok(), eos_token_ids={7})
    assert p.bad_words_token_ids == [[97, 98], [32, 97, 98]]
    assert p.all_stop_token_ids == {3, 7}
    q = SamplingParams(stop_token_ids=[3], ignore_eos=True)
    q.update_from_tokenizer(_Tok(), eos_token_ids={7})
    assert q.all_stop_token_ids == {3}
