"""Conformance with vLLM's OpenAI server, as a table: request -> status and response shape.

One Serve application (served name ``tiny``, a short context so "up to the remaining context"
is quick), raw HTTP for the table and the official `openai` package for a subset."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.ray

APP = "conformance"
SERVED = "tiny"
MAX_MODEL_LEN = 96
RAISING_FQCN = "tests.fixtures.seed_processors:RaisingLogitsProcessor"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base_url(serve_ports, tiny_model_dir):
    from cluster.cli.launch import wait_ready
    from cluster.config import LogitpoolConfig
    from tests.cluster.serving_helpers import deploy

    cfg = LogitpoolConfig.model_validate(
        {
            "engine": {
                "model": str(tiny_model_dir),
                "max_num_seqs": 8,
                "max_model_len": MAX_MODEL_LEN,
                "logits_processors": [RAISING_FQCN],
            },
            "workers": {"num_replicas": 1, "num_cpus": 1},
            "server": {"http_port": serve_ports[0], "grpc_port": serve_ports[1]},
            "app_name": APP,
            "served_model_name": SERVED,
        }
    )
    deploy(cfg)
    wait_ready("127.0.0.1", serve_ports[0], timeout_s=180)
    yield f"http://127.0.0.1:{serve_ports[0]}"
    from ray import serve

    serve.delete(APP)


def _error(status: int, param: str | None, kind: str = "invalid_request_error", says: str = "") -> Callable:
    def check(body: dict[str, Any]) -> None:
        err = body["error"]
        assert (err["code"], err["param"], err["type"]) == (status, param, kind), err
        assert says in err["message"], err

    return check


def _length_to_context(body: dict[str, Any]) -> None:
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    u = body["usage"]
    assert u["completion_tokens"] == MAX_MODEL_LEN - u["prompt_tokens"] > 16, u


def _served(obj: str) -> Callable:
    def check(body: dict[str, Any]) -> None:
        assert body["model"] == SERVED and body["object"] == obj
        assert all("stop_reason" in c for c in body["choices"])

    return check


def _text_offsets(body: dict[str, Any]) -> None:
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["text_offset"]) == len(lp["tokens"]) == 5
    expected = [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert lp["text_offset"] == expected


def _echoed(prompt: str, completion_tokens: int) -> Callable:
    """`echo`: the prompt first in text and logprobs (its first token's logprob null), offsets over both."""

    def check(body: dict[str, Any]) -> None:
        (choice,) = body["choices"]
        n_prompt = body["usage"]["prompt_tokens"]
        assert choice["text"].startswith(prompt) and body["usage"]["completion_tokens"] == completion_tokens
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n_prompt + completion_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert len(choice["prompt_logprobs"]) == n_prompt and choice["prompt_logprobs"][0] is None
        if completion_tokens == 0:
            assert (choice["text"], choice["finish_reason"]) == (prompt, "length")

    return check


def _chat_prompt_logprobs(body: dict[str, Any]) -> None:
    plp = body["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    assert all(
        len(p) in (1, 2) and all(set(v) == {"logprob", "rank", "decoded_token"} for v in p.values()) for p in plp[1:]
    )


def _models(body: dict[str, Any]) -> None:
    (m,) = body["data"]
    assert (m["id"], m["object"], m["max_model_len"]) == (SERVED, "model", MAX_MODEL_LEN)


C, CC = "/v1/completions", "/v1/chat/completions"
TABLE: list[tuple[str, str, dict[str, Any] | None, int, Callable]] = [
    ("chat_no_max_tokens_fills_context", CC, {"messages": CHAT, "ignore_eos": True}, 200, _length_to_context),
    (
        "chat_max_completion_tokens_0",
        CC,
        {"messages": CHAT, "max_completion_tokens": 0},
        400,
        _error(400, "max_completion_tokens"),
    ),
    ("completion_max_tokens_0", C, {"prompt": "x", "max_tokens": 0}, 400, _error(400, "max_tokens")),
    (
        "stream_options_without_stream",
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        _error(400, "stream_options"),
    ),
    (
        "chat_stream_options_without_stream",
        CC,
        {"messages": CHAT, "stream_options": {"include_usage": True}},
        400,
        _error(400, "stream_options"),
    ),
    ("empty_prompt", C, {"prompt": ""}, 400, _error(400, "prompt")),
    ("empty_prompt_list", C, {"prompt": []}, 400, _error(400, "prompt")),
    ("empty_prompt_in_list", C, {"prompt": ["x", ""]}, 400, _error(400, "prompt")),
    ("suffix", C, {"prompt": "x", "suffix": "y"}, 400, _error(400, "suffix", says="not supported")),
    (
        "echo_max_tokens_0",
        C,
        {"prompt": "def f(", "echo": True, "max_tokens": 0, "logprobs": 2},
        200,
        _echoed("def f(", 0),
    ),
    (
        "echo_and_completion",
        C,
        {"prompt": "def f(", "echo": True, "max_tokens": 3, "logprobs": 1, "ignore_eos": True},
        200,
        _echoed("def f(", 3),
    ),
    ("echo_logprobs_over_cap", C, {"prompt": "x", "echo": True, "logprobs": 21}, 400, _error(400, "logprobs")),
    (
        "prompt_logprobs_over_cap",
        C,
        {"prompt": "x", "prompt_logprobs": 21},
        400,
        _error(400, "prompt_logprobs", says="<= 20"),
    ),
    ("prompt_logprobs_negative", C, {"prompt": "x", "prompt_logprobs": -2}, 400, _error(400, "prompt_logprobs")),
    ("prompt_logprobs_all_over_cap", C, {"prompt": "x", "prompt_logprobs": -1}, 400, _error(400, "prompt_logprobs")),
    ("chat_prompt_logprobs", CC, {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 1}, 200, _chat_prompt_logprobs),
    ("unknown_model", C, {"prompt": "x", "model": "gpt-4"}, 404, _error(404, "model", "NotFoundError", "gpt-4")),
    ("unknown_model_chat", CC, {"messages": CHAT, "model": "gpt-4"}, 404, _error(404, "model", "NotFoundError")),
    (
        "unknown_model_before_validation",
        C,
        {"prompt": "", "model": "gpt-4"},
        404,
        _error(404, "model", "NotFoundError"),
    ),
    ("model_omitted", C, {"prompt": "x", "max_tokens": 2}, 200, _served("text_completion")),
    ("model_served", C, {"prompt": "x", "max_tokens": 2, "model": SERVED}, 200, _served("text_completion")),
    ("chat_model_echoed", CC, {"messages": CHAT, "max_tokens": 2}, 200, _served("chat.completion")),
    ("text_offset", C, {"prompt": "def f(", "max_tokens": 5, "logprobs": 1, "ignore_eos": True}, 200, _text_offsets),
    ("models", "/v1/models", None, 200, _models),
    ("unknown_path", "/v1/nothing", None, 404, _error(404, None, "not_found")),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "check"), TABLE, ids=[row[0] for row in TABLE])
def test_conformance_table(base_url, name, path, body, status, check):
    r = (
        httpx.get(f"{base_url}{path}", timeout=60)
        if body is None
        else httpx.post(f"{base_url}{path}", json=body, timeout=60)
    )
    assert r.status_code == status, r.text
    check(r.json())


def _events(base_url: str, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{base_url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def _greedy(base_url: str, n: int) -> dict[str, Any]:
    body = {"prompt": "class Foo", "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{base_url}{C}", json=body, timeout=60).json()["choices"][0]


def test_stop_reason_and_include_stop_str(base_url):
    free = _greedy(base_url, 12)
    stop = free["text"][4:7]
    prefix = free["text"][: free["text"].index(stop)]
    body = {"prompt": "class Foo", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}
    cut = httpx.post(f"{base_url}{C}", json=body, timeout=60).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"], cut["stop_reason"]) == (prefix, "stop", stop)
    kept = httpx.post(f"{base_url}{C}", json={**body, "include_stop_str_in_output": True}, timeout=60).json()
    assert kept["choices"][0]["text"] == prefix + stop
    streamed = [json.loads(e) for e in _events(base_url, C, {**body, "include_stop_str_in_output": True})[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in streamed) == prefix + stop
    assert streamed[-1]["choices"][0]["stop_reason"] == stop
    tok = free["token_ids"][3]
    by_id = httpx.post(f"{base_url}{C}", json={**body, "stop": None, "stop_token_ids": [tok]}, timeout=60).json()
    assert (by_id["choices"][0]["finish_reason"], by_id["choices"][0]["stop_reason"]) == ("stop", tok)


def test_stream_created_constant_and_done(base_url):
    body = {
        "prompt": "def f(",
        "max_tokens": 8,
        "ignore_eos": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    events = _events(base_url, C, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2 and len({ch["created"] for ch in chunks}) == 1
    assert all(ch["model"] == SERVED for ch in chunks)
    # Streamed text offsets continue where the previous chunk's text ended.
    offsets = [o for ch in chunks[:-1] for o in ch["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for ch in chunks[:-1] for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    chat = [json.loads(e) for e in _events(base_url, CC, {"messages": CHAT, "max_tokens": 6})[:-1]]
    assert len({ch["created"] for ch in chat}) == 1


@pytest.mark.parametrize("path", [C, CC])
def test_stream_error_then_done(base_url, path):
    body = {"max_tokens": 6, "vllm_xargs": {"raise_in": "apply"}}
    body.update({"prompt": "x"} if path == C else {"messages": CHAT})
    events = _events(base_url, path, body)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "request_failed"


def test_openai_sdk_subset(base_url):
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=60)
    assert [m.id for m in oai.models.list()] == [SERVED]
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model"
    chat = oai.chat.completions.create(model=SERVED, messages=CHAT, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens > 16
    assert chat.model == SERVED and chat.choices[0].model_extra["stop_reason"] is None
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        oai.completions.create(model=SERVED, prompt="x", max_tokens=2, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        oai.chat.completions.create(model=SERVED, messages=CHAT, max_completion_tokens=0)
    stream = list(
        oai.completions.create(model=SERVED, prompt="x", max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    )
    assert len(stream) >= 2 and len({ch.created for ch in stream}) == 1


def test_echo_loglikelihood_with_openai_sdk(base_url, tiny_model):
    """lm-eval-harness's loglikelihood request: token ids, echo, max_tokens 0, logprobs; values are
    the model's log-softmax over the prompt (a plain transformers forward here)."""
    import torch

    ids = tiny_model.tokenizer.encode("def add(a, b): return a + b")
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=60)
    out = oai.completions.create(model=SERVED, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0.0)
    (choice,) = out.choices
    assert choice.text == tiny_model.tokenizer.decode(ids) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) == out.usage.prompt_tokens
    with torch.inference_mode():
        ref = torch.log_softmax(tiny_model.model(torch.tensor([ids], device=tiny_model.device)).logits[0].float(), -1)
    expected = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-3)
    assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])
    streamed = list(oai.completions.create(model=SERVED, prompt=ids, echo=True, max_tokens=0, logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == choice.text
    assert [
        v for ch in streamed if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs
    ] == lp.token_logprobs


def test_stream_echo_sends_the_prompt_first(base_url):
    body = {"prompt": "class Foo", "echo": True, "max_tokens": 4, "logprobs": 0, "ignore_eos": True, "temperature": 0.0}
    chunks = [json.loads(e) for e in _events(base_url, C, body)[:-1]]
    whole = httpx.post(f"{base_url}{C}", json=body, timeout=60).json()["choices"][0]
    assert chunks[0]["choices"][0]["text"].startswith("class Foo")
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["text"]
    offsets = [o for ch in chunks for o in ch["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_grpc_prompt_logprobs_round_trip(base_url, serve_ports):
    from client import Client

    with Client(f"127.0.0.1:{serve_ports[1]}", timeout=60, application=APP) as c:
        out = c.generate("def f(", max_tokens=1, prompt_logprobs=2)
        streamed = list(c.stream("def f(", max_tokens=2, prompt_logprobs=2))
    http = httpx.post(
        f"{base_url}{C}", json={"prompt": "def f(", "max_tokens": 1, "prompt_logprobs": 2}, timeout=60
    ).json()["choices"][0]["prompt_logprobs"]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(http) == out.usage.prompt_tokens
    for g, h in zip(out.prompt_logprobs[1:], http[1:]):
        assert h[str(g.token_id)]["rank"] == g.rank and h[str(g.token_id)]["logprob"] == pytest.approx(
            g.logprob, abs=1e-5
        )
        assert {t.token_id for t in g.top} == {int(k) for k in h}
    assert streamed[0].prompt_logprobs == out.prompt_logprobs
    assert all(ch.prompt_logprobs is None for ch in streamed[1:])
