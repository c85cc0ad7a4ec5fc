"""What clients expect, on a real deployment through the official `openai` package (httpx for
vLLM's /tokenize and /detokenize, which the SDK lacks): one live request per route and rule whose
Ray-free tests are tests/cluster_rayfree/test_frontend_clients.py, here against the real engine (its
prefix cache, its grammar masks).

The model is the tiny one with a chat template that starts with ``{{ bos_token }}``, as Llama 3's,
Mistral's and Gemma's do: the case where adding the tokenizer's BOS on top doubled it.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.cluster.serving_helpers import deployed, error_of, post

pytestmark = pytest.mark.ray

APP = "clients"
SERVED = "tiny-bos"
BLOCK_SIZE = 16
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its chat template led by the BOS token (weights linked, not copied)."""
    out = tmp_path_factory.mktemp("bos-model")
    for f in tiny_model_dir.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f)
        else:
            shutil.copy(f, out / f.name)
    template = out / "chat_template.jinja"
    template.write_text("{{ bos_token }}" + template.read_text())
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def serving(serve_ports, model_dir):
    engine = {"max_num_seqs": 8, "max_model_len": 512, "block_size": BLOCK_SIZE}
    yield from deployed(serve_ports, model_dir, APP, engine, served_model_name=SERVED)


@pytest.fixture(scope="module")
def base(serving) -> str:
    return f"http://127.0.0.1:{serving.server.http_port}"


def test_chat_prompt_has_the_templates_bos_only(oai: openai.OpenAI, tokenizer: Any) -> None:
    expected = tokenizer.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert expected[0] == tokenizer.bos_token_id != expected[1]
    out = oai.chat.completions.create(model=SERVED, messages=MSGS, max_tokens=1, extra_body={"return_token_ids": True})
    assert out.usage.prompt_tokens == len(expected)
    assert out.model_extra["prompt_token_ids"] == list(expected)


def test_completions_add_special_tokens(oai: openai.OpenAI, tokenizer: Any) -> None:
    text = "def main("
    with_bos = oai.completions.create(model=SERVED, prompt=text, max_tokens=1)
    bare = oai.completions.create(model=SERVED, prompt=text, max_tokens=1, extra_body={"add_special_tokens": False})
    assert with_bos.usage.prompt_tokens == len(tokenizer.encode(text)) == bare.usage.prompt_tokens + 1


def test_retrieve_model(oai: openai.OpenAI) -> None:
    card = oai.models.retrieve(SERVED)
    assert (card.id, card.model_extra["max_model_len"]) == (SERVED, 512)
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("gpt-4")
    assert err.value.body["param"] == "model"


LOCATE = {
    "type": "object",
    "properties": {"place": {"$ref": "#/$defs/Place"}, "when": {"$ref": "#/$defs/Day"}},
    "required": ["place", "when"],
    "additionalProperties": False,
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "Day": {"enum": ["mon", "tue"]},
    },
}
COUNT = {
    "type": "object",
    "properties": {"n": {"$ref": "#/$defs/Small"}},
    "required": ["n"],
    "additionalProperties": False,
    "$defs": {"Small": {"type": "integer", "minimum": 0, "maximum": 9}},
}


def test_required_tool_call_with_local_references(oai: openai.OpenAI) -> None:
    schemas = {"locate": LOCATE, "count": COUNT}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    for seed in range(3):
        out = oai.chat.completions.create(
            model=SERVED, messages=MSGS, tools=tools, tool_choice="required", max_tokens=256, seed=seed
        )
        (choice,) = out.choices
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tokenize_and_detokenize(base: str, tokenizer: Any) -> None:
    text = "def main(x):"
    r = post(base, {"prompt": text, "return_token_strs": True}, "/tokenize")
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(text)
    assert r.json() == {
        "count": len(ids),
        "max_model_len": 512,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    chat = post(base, {"messages": MSGS}, "/tokenize").json()
    assert chat["tokens"] == tokenizer.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)["input_ids"]
    back = post(base, {"tokens": ids}, "/detokenize")
    assert back.json() == {"prompt": tokenizer.decode(ids)}
    assert error_of(post(base, {"tokens": [10**9]}, "/detokenize"), 400)["param"] == "tokens"


def test_cached_tokens_count_the_prefix_cache_hits(oai: openai.OpenAI) -> None:
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 8  # fresh: cold first
    cold = oai.completions.create(model=SERVED, prompt=prompt, max_tokens=1)
    n = cold.usage.prompt_tokens
    assert n > 2 * BLOCK_SIZE and cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = oai.completions.create(model=SERVED, prompt=prompt, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    streamed = list(
        oai.completions.create(
            model=SERVED, prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens_details.cached_tokens
    chat_msgs = [{"role": "user", "content": prompt}]
    oai.chat.completions.create(model=SERVED, messages=chat_msgs, max_tokens=1)
    chat = oai.chat.completions.create(model=SERVED, messages=chat_msgs, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= BLOCK_SIZE


def test_return_token_ids_and_truncation(oai: openai.OpenAI, tokenizer: Any) -> None:
    text = "class Foo(Bar): pass"
    body = {"return_token_ids": True, "truncate_prompt_tokens": 4, "ignore_eos": True}
    out = oai.completions.create(model=SERVED, prompt=text, max_tokens=3, extra_body=body)
    extra = out.choices[0].model_extra
    assert extra["prompt_token_ids"] == tokenizer.encode(text)[-4:] and out.usage.prompt_tokens == 4
    assert len(extra["token_ids"]) == out.usage.completion_tokens == 3 and extra["prompt_logprobs"] is None
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=SERVED, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": 513})
    assert err.value.body["param"] == "truncate_prompt_tokens"


def test_an_unimplemented_vllm_field_is_a_400(oai: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=SERVED, messages=MSGS, max_tokens=1, extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "use_beam_search"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": "s"}, timeout=60)
    assert error_of(r, 400)["param"] == "cache_salt"


def test_grpc_add_special_tokens_and_cached_tokens(serving, tokenizer: Any) -> None:
    """gRPC has HTTP's two: a text prompt's BOS on request (default on), and the prefix-cache
    hits in the usage (unary and streamed)."""
    from client import Client

    prompt = f"{uuid.uuid4().hex} " + "a stitch in time saves nine " * 10
    with Client(f"127.0.0.1:{serving.server.grpc_port}", timeout=60, application=APP) as c:
        cold = c.generate(prompt, max_tokens=1)
        bare = c.generate(prompt, max_tokens=1, add_special_tokens=False)
        assert cold.usage.prompt_tokens == len(tokenizer.encode(prompt)) == bare.usage.prompt_tokens + 1
        assert cold.usage.cached_tokens == 0
        warm = c.generate(prompt, max_tokens=1, add_special_tokens=True)
        assert warm.usage.cached_tokens == (cold.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
        with c.stream(prompt, max_tokens=2) as s:
            chunks = list(s)
        (last,) = [ch for ch in chunks if ch.usage is not None]
        assert last.usage.cached_tokens == warm.usage.cached_tokens
