"""The OpenAI protocol conversion without a cluster: request rules vLLM's server applies, and the
pieces of the response shape (stop strings, text offsets, served name, the 404 body)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.chat import fit_to_context
from cluster.config import LogitpoolConfig
from cluster.errors import ModelNotFound, classify, error_body
from cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_logprobs,
    output_text,
)
from worker.outputs import CompletionOutput, Logprob
from worker.sampling_params import INT64_MAX

CHAT = [{"role": "user", "content": "hi"}]


def test_chat_without_max_tokens_runs_to_the_context():
    params = ChatCompletionRequest.model_validate({"messages": CHAT, "min_tokens": 40}).sampling_params()
    assert params.max_tokens == INT64_MAX
    fitted = fit_to_context(params, prompt_len=30, max_model_len=64)
    assert (fitted.max_tokens, fitted.min_tokens) == (34, 34)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 7, "max_tokens": 5}, 7),
        ({"max_tokens": 500}, 500),
    ],
)
def test_chat_max_tokens_given(fields, expected):
    assert ChatCompletionRequest.model_validate({"messages": CHAT, **fields}).sampling_params().max_tokens == expected


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ChatCompletionRequest, {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        (ChatCompletionRequest, {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "echo": True, "prompt_logprobs": -2}, "prompt_logprobs"),
        (ChatCompletionRequest, {"messages": CHAT, "prompt_logprobs": -3}, "prompt_logprobs"),
    ],
)
def test_zero_budgets_and_prompt_logprobs_name_the_field(model, body, param):
    with pytest.raises(ValueError) as err:
        model.model_validate(body).sampling_params()
    assert error_body(classify(err.value))["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "suffix": "!"}, "suffix"),
    ],
)
def test_rejected_at_parse(body, param):
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate(body)
    assert error_body(classify(err.value))["error"]["param"] == param


@pytest.mark.parametrize("prompt", ["", [], ["x", ""], [[1], []]])
def test_empty_prompts_rejected(prompt):
    from cluster.frontend import check_prompts  # the rule both protocols share

    with pytest.raises(ValueError, match="prompt: must not be empty"):
        check_prompts(CompletionRequest.model_validate({"prompt": prompt}).prompts())


def test_stream_options_with_stream_accepted():
    assert CompletionRequest.model_validate(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    ).include_usage


def _out(text: str, reason: str | None, stop: str | int | None) -> CompletionOutput:
    return CompletionOutput(0, text, [1], None, None, finish_reason=reason, stop_reason=stop)


@pytest.mark.parametrize(
    ("out", "include", "expected"),
    [
        (_out("ab", "stop", "cd"), True, "abcd"),
        (_out("ab", "stop", "cd"), False, "ab"),
        (_out("ab", "stop", 7), True, "ab"),  # a stop token id adds no text
        (_out("ab", "length", None), True, "ab"),
        (_out("ab", None, None), True, "ab"),  # mid-stream
    ],
)
def test_include_stop_str_in_output(out, include, expected):
    assert output_text(out, include) == expected


def test_text_offset_counts_decoded_tokens():
    pieces = {1: "ab", 2: "c", 3: "def"}
    c = CompletionOutput(0, "abcdef", [1, 2, 3], None, [{t: Logprob(-1.0, 1)} for t in (1, 2, 3)])
    lp = completion_logprobs(c, pieces.__getitem__, text_offset=10)
    assert lp["text_offset"] == [10, 12, 13] and lp["tokens"] == ["ab", "c", "def"]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({}, "tiny-llama"),
        ({"engine": {"model": "/srv/models/my-model"}}, "my-model"),
        ({"engine": {"model": "/srv/models/my-model/"}}, "my-model"),
        ({"engine": {"model": "Qwen/Qwen2.5-0.5B"}}, "Qwen/Qwen2.5-0.5B"),
        ({"engine": {"model": "/srv/m"}, "served_model_name": "prod"}, "prod"),
    ],
)
def test_served_name_is_never_a_path(fields, name):
    assert LogitpoolConfig.model_validate(fields).served_name == name


def test_unknown_model_is_openai_404():
    err = error_body(classify(ModelNotFound("gpt-4")))["error"]
    assert (err["code"], err["type"], err["param"]) == (404, "NotFoundError", "model") and "gpt-4" in err["message"]


def test_minus_one_logprobs_reach_the_engine_as_the_whole_vocabulary():
    """vLLM's -1 (every token) on chat's top_logprobs, completions' logprobs and prompt_logprobs;
    the engine resolves it against its vocabulary and max_logprobs (SamplingParams.resolved)."""
    chat = ChatCompletionRequest.model_validate({"messages": CHAT, "logprobs": True, "top_logprobs": -1})
    assert chat.sampling_params().logprobs == -1
    done = CompletionRequest.model_validate({"prompt": "x", "logprobs": -1, "prompt_logprobs": -1}).sampling_params()
    assert (done.logprobs, done.prompt_logprobs) == (-1, -1)
    assert (done.resolved(3000).logprobs, done.resolved(3000).prompt_logprobs) == (3000, 3000)
