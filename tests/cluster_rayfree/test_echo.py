"""`echo` and `prompt_logprobs` on the OpenAI protocol, without a cluster: request conversion and
the response shape (prompt first, its first token's logprob null, offsets over prompt + completion)."""

from __future__ import annotations

import pytest

from cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Echo,
    after_echo,
    chat_response,
    completion_response,
    prompt_logprobs_json,
)
from worker.outputs import CompletionOutput, Logprob, RequestOutput

WORDS = {1: "The", 2: " cat", 3: " sat", 4: " on", 5: " mat"}


def decode(tok: int) -> str:
    return WORDS[tok]


def _pos(tok: int, lp: float, rank: int, top: int | None = None) -> dict[int, Logprob]:
    position = {tok: Logprob(lp, rank, decode(tok))}
    if top is not None and top != tok:
        position[top] = Logprob(lp + 1.0, 1, decode(top))
    return position


PROMPT_IDS = [1, 2, 3]
PROMPT_LP = [None, _pos(2, -2.0, 3, top=5), _pos(3, -0.5, 1)]


def _out(ids: list[int], finish: str | None = "length") -> RequestOutput:
    c = CompletionOutput(0, "".join(map(decode, ids)), ids, -1.0, [_pos(t, -1.0, 2, top=1) for t in ids], finish)
    return RequestOutput("r", None, PROMPT_IDS, [c], True, prompt_logprobs=PROMPT_LP)


def test_echo_only_asks_for_one_token_and_prompt_logprobs():
    body = CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 2})
    params = body.sampling_params()
    assert body.echo_only and (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 2, 2)
    given = CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 4})
    assert given.sampling_params().prompt_logprobs == 4 and not given.echo_only


def test_max_tokens_0_without_echo_is_still_rejected():
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0}).sampling_params()


@pytest.mark.parametrize("body", [{"prompt": "x"}, {"messages": [{"role": "user", "content": "hi"}]}])
def test_prompt_logprobs_field_reaches_sampling_params(body):
    model = CompletionRequest if "prompt" in body else ChatCompletionRequest
    assert model.model_validate({**body, "prompt_logprobs": 3}).sampling_params().prompt_logprobs == 3


def _check_offsets(lp: dict) -> None:
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_echo_puts_the_prompt_first():
    echo = Echo("The cat sat", PROMPT_IDS, PROMPT_LP)
    body = completion_response("id", "m", [_out([4, 5])], decode, echoes=[echo])
    (choice,) = body["choices"]
    assert choice["text"] == "The cat sat on mat"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["The", " cat", " sat", " on", " mat"]
    assert lp["token_logprobs"] == [None, -2.0, -0.5, -1.0, -1.0]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {" cat": -2.0, " mat": -1.0}
    _check_offsets(lp)
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # vLLM's shape: token ids are generated only (never the echoed prompt's), null unless asked.
    assert (choice["token_ids"], choice["prompt_token_ids"]) == (None, None)
    asked = completion_response("id", "m", [_out([4, 5])], decode, token_ids=True, echoes=[echo])["choices"][0]
    assert (asked["token_ids"], asked["prompt_token_ids"]) == ([4, 5], PROMPT_IDS)
    assert choice["prompt_logprobs"][1] == {
        "2": {"logprob": -2.0, "rank": 3, "decoded_token": " cat"},
        "5": {"logprob": -1.0, "rank": 1, "decoded_token": " mat"},
    }


def test_echo_only_returns_the_prompt_alone():
    echo = Echo("The cat sat", PROMPT_IDS, PROMPT_LP, only=True)
    body = completion_response("id", "m", [_out([4], finish="stop")], decode, echoes=[echo])
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("The cat sat", "length", None)
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -0.5]
    _check_offsets(choice["logprobs"])
    assert body["usage"]["completion_tokens"] == 0


def test_echo_without_logprobs_has_none():
    out = _out([4])
    out.outputs[0].logprobs = None
    body = completion_response("id", "m", [out], decode, echoes=[Echo("The cat sat", PROMPT_IDS, None)])
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["text"] == "The cat sat on"


def test_later_stream_deltas_of_echo_only_show_nothing_generated():
    c = CompletionOutput(0, " on", [4], None, None, "stop", 4)
    assert after_echo(c, Echo("x", [1], None)) is c
    hidden = after_echo(c, Echo("x", [1], None, only=True))
    assert (hidden.text, hidden.token_ids, hidden.finish_reason, hidden.stop_reason) == ("", [], "length", None)


def test_chat_response_carries_prompt_logprobs():
    body = chat_response("id", "m", _out([4]), decode, 0)
    assert body["prompt_logprobs"][0] is None and set(body["prompt_logprobs"][2]) == {"3"}
    assert prompt_logprobs_json(None) is None


def test_each_prompt_echoes_its_own_text_in_all_its_choices():
    a, b = _out([4]), _out([5])
    b.outputs.append(CompletionOutput(1, " on", [4], None, None, "length"))
    a.outputs.append(CompletionOutput(1, " mat", [5], None, None, "length"))
    for c in a.outputs + b.outputs:
        c.logprobs = None
    echoes = [Echo("A", PROMPT_IDS, None), Echo("B", PROMPT_IDS, None)]
    body = completion_response("id", "m", [a, b], decode, echoes=echoes)
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [
        (0, "A on"),
        (1, "A mat"),
        (2, "B mat"),
        (3, "B on"),
    ]
    assert body["usage"]["completion_tokens"] == 4
