"""What clients expect of the HTTP front end, through the official `openai` package where it has
the call (httpx where it has not: /tokenize, /detokenize), without a Ray cluster: the real
adapters and routes, the worker deployment in Serve's local testing mode over the fake engine
(tests/cluster_rayfree/test_frontend_local.py's fixtures). The token ids the engine receives are the
oracle for prompt handling (chat template, special tokens, truncation)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import openai
import pytest

from cluster.frontend import Frontend
from cluster.openai.adapter import HttpAdapter
from cluster.openai.routes import build_api
from tests.cluster_rayfree.fake_engine import FakeEngine, fake_token
from tests.cluster_rayfree.test_frontend_local import KEY, cfg, fe, http, worker  # noqa: F401 - fixtures

T = TypeVar("T")
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def sdk(front: Frontend, call: Callable[[openai.AsyncOpenAI], Awaitable[T]], key: str | None = KEY) -> T:
    """``call`` with an AsyncOpenAI client whose requests go straight to the ASGI app."""

    async def run() -> T:
        transport = httpx.ASGITransport(app=build_api(HttpAdapter(front)))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as hc:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=key or "none", http_client=hc, max_retries=0)
            return await call(client)

    return asyncio.run(run())


def seen_prompts() -> list[Any]:
    return [prompt for _, prompt, _ in FakeEngine.seen]


def template_ids(front: Frontend, msgs: list[dict[str, str]], **kw: Any) -> list[int]:
    """transformers' own tokenized chat (the reference vLLM matches)."""
    return list(front.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kw)["input_ids"])


# -- 1. a chat prompt is its template, tokenized without adding special tokens ---------------


def test_chat_prompt_is_the_template_alone_with_a_bos_template(fe: Frontend) -> None:  # noqa: F811 - fixture
    fe.tokenizer.chat_template = "{{ bos_token }}" + fe.tokenizer.chat_template  # as Llama 3, Mistral, Gemma
    expected = template_ids(fe, MSGS)
    bos = fe.tokenizer.bos_token_id
    assert expected[0] == bos and expected[1] != bos

    out = sdk(fe, lambda c: c.chat.completions.create(model=fe.model_name, messages=MSGS, max_tokens=2))
    assert out.usage.prompt_tokens == len(expected)
    assert seen_prompts() == [expected]  # one BOS: the template's

    # add_special_tokens: true puts the tokenizer's on top (vLLM's flag; its default is false for chat).
    doubled = sdk(
        fe,
        lambda c: c.chat.completions.create(
            model=fe.model_name, messages=MSGS, max_tokens=2, extra_body={"add_special_tokens": True}
        ),
    )
    assert doubled.usage.prompt_tokens == len(expected) + 1 and seen_prompts()[1] == [bos, *expected]


def test_chat_generation_prompt_and_continue_final_message(fe: Frontend) -> None:  # noqa: F811 - fixture
    prefill = [*MSGS, {"role": "assistant", "content": "Sure"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    sdk(fe, lambda c: c.chat.completions.create(model=fe.model_name, messages=prefill, max_tokens=1, extra_body=body))
    reference = fe.tokenizer.apply_chat_template(
        prefill, tokenize=True, add_generation_prompt=False, continue_final_message=True
    )["input_ids"]
    assert seen_prompts() == [list(reference)] and fe.tokenizer.decode(reference).endswith("Sure")
    with pytest.raises(openai.BadRequestError) as err:
        sdk(
            fe,
            lambda c: c.chat.completions.create(
                model=fe.model_name, messages=prefill, max_tokens=1, extra_body={"continue_final_message": True}
            ),
        )
    assert err.value.body["param"] == "continue_final_message"


# -- 2. add_special_tokens on completions (default true) --------------------------------------


def test_completions_add_special_tokens(fe: Frontend) -> None:  # noqa: F811 - fixture
    text = "def main("
    bare = fe.tokenizer.encode(text, add_special_tokens=False)
    with_bos = fe.tokenizer.encode(text)
    assert with_bos == [fe.tokenizer.bos_token_id, *bare]
    a = sdk(fe, lambda c: c.completions.create(model=fe.model_name, prompt=text, max_tokens=1))
    b = sdk(
        fe,
        lambda c: c.completions.create(
            model=fe.model_name, prompt=text, max_tokens=1, extra_body={"add_special_tokens": False}
        ),
    )
    assert seen_prompts() == [with_bos, bare]
    assert (a.usage.prompt_tokens, b.usage.prompt_tokens) == (len(with_bos), len(bare))


# -- 3. GET /v1/models/{model} ----------------------------------------------------------------


def test_retrieve_model(fe: Frontend) -> None:  # noqa: F811 - fixture
    card = sdk(fe, lambda c: c.models.retrieve(fe.model_name))
    assert (card.id, card.object, card.model_extra["max_model_len"]) == (fe.model_name, "model", fe.max_model_len)
    listed = sdk(fe, lambda c: c.models.list())
    assert [m.model_dump() for m in listed.data] == [card.model_dump()]
    with pytest.raises(openai.NotFoundError) as err:
        sdk(fe, lambda c: c.models.retrieve("gpt-4"))
    assert err.value.body["param"] == "model" and "gpt-4" in err.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        sdk(fe, lambda c: c.models.retrieve(fe.model_name), key="wrong")


def test_retrieve_a_model_whose_name_has_a_slash(fe: Frontend) -> None:  # noqa: F811 - fixture
    fe.model_name = "org/some-model"
    assert sdk(fe, lambda c: c.models.retrieve("org/some-model")).id == "org/some-model"
    assert http(fe, "GET", "/v1/models/org/other").status_code == 404


# -- 5. /tokenize and /detokenize -------------------------------------------------------------


def test_tokenize_prompt_and_chat(fe: Frontend) -> None:  # noqa: F811 - fixture
    text = "def main(x):"
    r = http(fe, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = fe.tokenizer.encode(text)
    assert r.json() == {
        "count": len(ids),
        "max_model_len": fe.max_model_len,
        "tokens": ids,
        "token_strs": fe.tokenizer.convert_ids_to_tokens(ids),
    }
    bare = http(fe, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[1:] and bare["token_strs"] is None

    chat = http(fe, "POST", "/tokenize", {"messages": MSGS}).json()
    assert chat["tokens"] == template_ids(fe, MSGS) and chat["count"] == len(chat["tokens"])
    open_turn = http(fe, "POST", "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert open_turn["tokens"] == list(
        fe.tokenizer.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=False)["input_ids"]
    )
    assert open_turn["count"] < chat["count"]

    # Any length: the caller is measuring (the context does not bound it).
    long = http(fe, "POST", "/tokenize", {"prompt": "ab " * fe.max_model_len}).json()
    assert long["count"] > fe.max_model_len

    back = http(fe, "POST", "/detokenize", {"tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": fe.tokenizer.decode(ids)}
    assert FakeEngine.seen == []  # nothing here reaches a worker


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": MSGS, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ],
)
def test_tokenizer_routes_reject_bad_input(fe: Frontend, path: str, body: dict, status: int, param: str) -> None:  # noqa: F811 - fixture
    r = http(fe, "POST", path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_routes_need_the_key(fe: Frontend) -> None:  # noqa: F811 - fixture
    assert http(fe, "POST", "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert http(fe, "POST", "/detokenize", {"tokens": [5]}, key="wrong").status_code == 401


def test_openapi_declares_the_tokenizer_bodies(fe: Frontend) -> None:  # noqa: F811 - fixture
    doc = http(fe, "GET", "/openapi.json").json()
    body = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in body["anyOf"]} == {
        "TokenizeCompletionRequest",
        "TokenizeChatRequest",
    }
    assert "/v1/models/{model}" in doc["paths"]


# -- 6. usage.prompt_tokens_details.cached_tokens ---------------------------------------------


def test_cached_tokens_reach_usage(fe: Frontend) -> None:  # noqa: F811 - fixture
    FakeEngine.cached_tokens = 3
    one = sdk(fe, lambda c: c.completions.create(model=fe.model_name, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=2))
    assert one.usage.prompt_tokens_details.cached_tokens == 6  # 3 per prompt
    chat = sdk(fe, lambda c: c.chat.completions.create(model=fe.model_name, messages=MSGS, max_tokens=2))
    assert chat.usage.prompt_tokens_details.cached_tokens == 3

    async def streamed(c: openai.AsyncOpenAI) -> tuple[Any, Any]:
        opts = {"include_usage": True}
        a = [
            ch
            async for ch in await c.completions.create(
                model=fe.model_name, prompt="x", max_tokens=2, stream=True, stream_options=opts
            )
        ]
        b = [
            ch
            async for ch in await c.chat.completions.create(
                model=fe.model_name, messages=MSGS, max_tokens=2, stream=True, stream_options=opts
            )
        ]
        return a[-1].usage, b[-1].usage

    a, b = sdk(fe, streamed)
    assert a.prompt_tokens_details.cached_tokens == b.prompt_tokens_details.cached_tokens == 3
    FakeEngine.cached_tokens = None  # a worker that says nothing: 0
    none = sdk(fe, lambda c: c.completions.create(model=fe.model_name, prompt="x", max_tokens=1))
    assert none.usage.prompt_tokens_details.cached_tokens == 0


# -- 7. vLLM's extra fields -------------------------------------------------------------------


def test_return_token_ids_and_the_null_fields(fe: Frontend) -> None:  # noqa: F811 - fixture
    prompt = [7, 8, 9]
    generated = [fake_token(prompt, i) for i in range(3)]
    plain = sdk(fe, lambda c: c.completions.create(model=fe.model_name, prompt=prompt, max_tokens=3))
    extra = plain.choices[0].model_extra
    assert (extra["token_ids"], extra["prompt_token_ids"], extra["prompt_logprobs"]) == (None, None, None)

    body = {"return_token_ids": True}
    out = sdk(fe, lambda c: c.completions.create(model=fe.model_name, prompt=prompt, max_tokens=3, extra_body=body))
    extra = out.choices[0].model_extra
    assert (extra["prompt_token_ids"], extra["token_ids"]) == (prompt, generated)
    echoed = sdk(
        fe,
        lambda c: c.completions.create(model=fe.model_name, prompt=prompt, max_tokens=3, echo=True, extra_body=body),
    )
    assert echoed.choices[0].model_extra["token_ids"] == generated  # output only, the echoed prompt is not in it

    chat = sdk(
        fe, lambda c: c.chat.completions.create(model=fe.model_name, messages=MSGS, max_tokens=3, extra_body=body)
    )
    (chat_prompt,) = seen_prompts()[3:]
    chat_generated = [fake_token(chat_prompt, i) for i in range(3)]
    assert chat.model_extra["prompt_token_ids"] == chat_prompt and chat.model_extra["prompt_logprobs"] is None
    assert chat.choices[0].model_extra["token_ids"] == chat_generated

    async def streamed(c: openai.AsyncOpenAI) -> tuple[list[Any], list[Any]]:
        a = await c.completions.create(model=fe.model_name, prompt=prompt, max_tokens=3, stream=True, extra_body=body)
        b = await c.chat.completions.create(
            model=fe.model_name, messages=MSGS, max_tokens=3, stream=True, extra_body=body
        )
        return [ch async for ch in a], [ch async for ch in b]

    a, b = sdk(fe, streamed)
    assert a[0].choices[0].model_extra["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in ch.choices[0].model_extra for ch in a[1:])
    assert [t for ch in a for t in ch.choices[0].model_extra["token_ids"]] == generated
    assert b[0].model_extra["prompt_token_ids"] == chat_prompt
    assert [t for ch in b for t in ch.choices[0].model_extra["token_ids"]] == chat_generated


def test_truncate_prompt_tokens(fe: Frontend) -> None:  # noqa: F811 - fixture
    ids = list(range(5, 30))

    def complete(**body: Any) -> Any:
        return sdk(fe, lambda c: c.completions.create(model=fe.model_name, prompt=ids, max_tokens=1, extra_body=body))

    assert complete(truncate_prompt_tokens=4).usage.prompt_tokens == 4
    complete(truncate_prompt_tokens=4, truncation_side="right")
    complete(truncate_prompt_tokens=100)  # longer than the prompt: all of it
    assert seen_prompts() == [ids[-4:], ids[:4], ids]

    # A text prompt past the context is fine when it is cut to fit.
    long = "ab " * fe.max_model_len
    out = sdk(
        fe,
        lambda c: c.completions.create(
            model=fe.model_name, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 8}
        ),
    )
    assert out.usage.prompt_tokens == 8 and seen_prompts()[-1] == fe.tokenizer.encode(long)[-8:]
    chat = sdk(
        fe,
        lambda c: c.chat.completions.create(
            model=fe.model_name, messages=MSGS, max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
        ),
    )
    assert chat.usage.prompt_tokens == 3 and seen_prompts()[-1] == template_ids(fe, MSGS)[-3:]

    for k in (fe.max_model_len + 1, 0, -2):
        with pytest.raises(openai.BadRequestError) as err:
            complete(truncate_prompt_tokens=k)
        assert err.value.body["param"] == "truncate_prompt_tokens", k
    assert len(FakeEngine.seen) == 5


@pytest.mark.parametrize(
    ("chat", "body", "param"),
    [
        (False, {"use_beam_search": True}, "use_beam_search"),
        (False, {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        (False, {"cache_salt": "s3cret"}, "cache_salt"),
        (True, {"echo": True}, "echo"),
        (True, {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        (
            True,
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_unimplemented_vllm_fields_are_400s(fe: Frontend, chat: bool, body: dict, param: str) -> None:  # noqa: F811 - fixture
    base: dict[str, Any] = {"messages": MSGS} if chat else {"prompt": "x"}
    r = http(fe, "POST", "/v1/chat/completions" if chat else "/v1/completions", {**base, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert FakeEngine.seen == []


def test_vllm_fields_sent_as_off_are_accepted(fe: Frontend) -> None:  # noqa: F811 - fixture
    """Clients send some fields at their "off" value (vLLM's own defaults): not a 400."""
    body = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True, "request_id": None}
    out = sdk(fe, lambda c: c.completions.create(model=fe.model_name, prompt="x", max_tokens=1, extra_body=body))
    assert out.choices[0].finish_reason == "length"


# -- tools (issue 18, items 5 and 6): the fake engine writes "<12><13>...", each "<" a possible
# start of hermes' "<tool_call>", held back and released as the next character rules it out ----

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def test_auto_tool_choice_streams_the_same_text_it_answers_whole(fe: Frontend) -> None:  # noqa: F811 - fixture
    async def both(c: openai.AsyncOpenAI) -> tuple[Any, list[Any]]:
        kw: dict[str, Any] = {"model": fe.model_name, "messages": MSGS, "max_tokens": 5, "tools": TOOLS}
        whole = await c.chat.completions.create(**kw)
        return whole, [ch async for ch in await c.chat.completions.create(**kw, stream=True)]

    whole, chunks = sdk(fe, both)
    message = whole.choices[0].message
    assert message.tool_calls is None and whole.choices[0].finish_reason == "length"
    assert message.content is not None and message.content.startswith("<")
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == message.content
    assert all(ch.choices[0].delta.tool_calls is None for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"


def test_the_tools_reach_the_chat_template_in_chat_and_tokenize(fe: Frontend) -> None:  # noqa: F811 - fixture
    """As vLLM: a template that shows the tools gets them, and /tokenize counts the same prompt."""
    fe.tokenizer.chat_template = "{% if tools %}[{{ tools[0]['function']['name'] }}]{% endif %}" + str(
        fe.tokenizer.chat_template
    )
    expected = template_ids(fe, MSGS, tools=TOOLS)
    assert expected != template_ids(fe, MSGS)
    sdk(fe, lambda c: c.chat.completions.create(model=fe.model_name, messages=MSGS, max_tokens=2, tools=TOOLS))
    assert seen_prompts() == [expected]
    assert http(fe, "POST", "/tokenize", {"messages": MSGS, "tools": TOOLS}).json()["tokens"] == expected
