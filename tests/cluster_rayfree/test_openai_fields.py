"""vLLM's request fields, each implemented or a 400 naming it — never silently ignored (no Ray).

The lists below are the fields of vLLM's request models (``vllm/entrypoints/openai/
completion/protocol.py`` ``CompletionRequest``, ``chat_completion/protocol.py``
``ChatCompletionRequest``, ``StreamOptions``; older releases' ``best_of``, ``guided_*``,
``logits_processors`` too), copied by hand: a field vLLM adds must be added here, and then
either implemented in cluster.openai.protocol or listed in cluster.openai.unimplemented.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from cluster.chat import PromptTokens
from cluster.errors import classify, error_body
from cluster.openai import unimplemented
from cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from cluster.openai.unimplemented import Unimplemented

# In both CompletionRequest and ChatCompletionRequest (the sampling block, most extras).
VLLM_BOTH = [
    "model",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "allowed_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "bad_words",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
    "best_of",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "logits_processors",
]

# CompletionRequest's own.
VLLM_COMPLETION_ONLY = [
    "prompt",
    "suffix",
    "prompt_embeds",
]
VLLM_COMPLETION = VLLM_BOTH + VLLM_COMPLETION_ONLY

# ChatCompletionRequest's own.
VLLM_CHAT_ONLY = [
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "include_reasoning",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "return_prompt_text",
    "structural_tag",
]
VLLM_CHAT = VLLM_BOTH + VLLM_CHAT_ONLY

VLLM_STREAM_OPTIONS = ["include_usage", "continuous_usage_stats"]

# vLLM's /tokenize request models (vllm/entrypoints/serve/tokenize/protocol.py).
VLLM_TOKENIZE_COMPLETION = ["model", "prompt", "add_special_tokens", "return_token_strs"]
VLLM_TOKENIZE_CHAT = [
    "model",
    "messages",
    "add_generation_prompt",
    "return_token_strs",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "tools",
]

CASES = [
    (CompletionRequest, VLLM_COMPLETION, unimplemented.COMPLETION),
    (ChatCompletionRequest, VLLM_CHAT, unimplemented.CHAT),
    (StreamOptions, VLLM_STREAM_OPTIONS, unimplemented.STREAM_OPTIONS),
    (TokenizeCompletionRequest, VLLM_TOKENIZE_COMPLETION, {}),
    (TokenizeChatRequest, VLLM_TOKENIZE_CHAT, unimplemented.TOKENIZE_CHAT),
]


@pytest.mark.parametrize(("model", "vllm", "refused"), CASES, ids=[c[0].__name__ for c in CASES])
def test_every_vllm_field_is_implemented_or_refused(
    model: type[BaseModel], vllm: list[str], refused: dict[str, Unimplemented]
) -> None:
    implemented = set(model.model_fields)
    assert not implemented & set(refused), "a field is both implemented and refused"
    missing = [name for name in vllm if name not in implemented and name not in refused]
    assert missing == [], f"vLLM fields neither implemented nor refused: {missing}"


def _asking(field: Unimplemented) -> Any:
    """A value that asks for what the field does (not null, not one of its "off" values)."""
    ok = field.accepted[0] if field.accepted else None
    if isinstance(ok, bool):
        return not ok
    if isinstance(ok, (int, float)):
        return ok + 2
    return "x"


BASES: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"prompt": "x"},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
    TokenizeChatRequest: {"messages": [{"role": "user", "content": "hi"}]},
}
REFUSED = [(model, name, field) for model, _, table in CASES if model in BASES for name, field in table.items()]


@pytest.mark.parametrize(("model", "name", "field"), REFUSED, ids=[f"{m.__name__}.{n}" for m, n, _ in REFUSED])
def test_a_refused_field_is_a_400_naming_it_unless_off(model: type[BaseModel], name: str, field: Unimplemented) -> None:
    with pytest.raises(ValidationError) as err:
        model.model_validate({**BASES[model], name: _asking(field)})
    body = error_body(classify(err.value))["error"]
    assert (body["code"], body["param"]) == (400, name) and "not implemented" in body["message"]
    for off in (None, *field.accepted):
        model.model_validate({**BASES[model], name: off})


def test_stream_options_fields_are_named_with_their_path() -> None:
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate(
            {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
        )
    assert error_body(classify(err.value))["error"]["param"] == "stream_options.continuous_usage_stats"
    ok = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    assert CompletionRequest.model_validate(ok).include_usage


def test_unknown_fields_are_still_ignored() -> None:
    """A field neither OpenAI nor vLLM has (a newer SDK's) is not refused."""
    CompletionRequest.model_validate({"prompt": "x", "some_future_field": 1})


# -- the prompt fields: add_special_tokens defaults, truncation -------------------------------


def test_add_special_tokens_defaults_are_vllms() -> None:
    assert CompletionRequest.model_validate({"prompt": "x"}).prompt_tokens.add_special_tokens is True
    assert ChatCompletionRequest.model_validate(BASES[ChatCompletionRequest]).prompt_tokens.add_special_tokens is False
    given = ChatCompletionRequest.model_validate({**BASES[ChatCompletionRequest], "add_special_tokens": True})
    assert given.prompt_tokens.add_special_tokens is True


@pytest.mark.parametrize(
    ("k", "side", "expected"),
    [
        (None, "left", list(range(10))),
        (3, "left", [7, 8, 9]),
        (3, "right", [0, 1, 2]),
        (10, "left", list(range(10))),
        (50, "left", list(range(10))),
        (-1, "left", list(range(10))),  # -1: max_model_len (64 here)
    ],
)
def test_truncation_keeps_the_last_or_first_k(k: int | None, side: str, expected: list[int]) -> None:
    tokens = PromptTokens(truncate_prompt_tokens=k, truncation_side=side)  # type: ignore[arg-type]  # parametrized sides, checked by the class
    assert tokens.truncate(list(range(10)), tokens.keep(64)) == expected


@pytest.mark.parametrize("k", [0, -2, 65])
def test_truncation_past_the_context_or_below_one_is_a_400(k: int) -> None:
    with pytest.raises(ValueError) as err:
        PromptTokens(truncate_prompt_tokens=k).keep(64)
    assert error_body(classify(err.value))["error"]["param"] == "truncate_prompt_tokens"
