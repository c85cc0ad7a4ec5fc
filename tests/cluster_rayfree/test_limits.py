"""Input hygiene without a cluster: the body checks, the request limits, the error shape, strict
JSON out, and the lenient gRPC deserializer. The live HTTP/gRPC repros are in test_hardening."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.config import LogitpoolConfig
from cluster.errors import classify, error_body
from cluster.grpc_servicers import WireRequest, _deferred
from cluster.limits import Limits, PayloadTooLarge, check_request, json_depth_exceeds, parse_json
from worker.sampling_params import SamplingParams

LIMITS = Limits()
BIG = Limits(**{name: 10**7 for name in Limits.model_fields if name.startswith("max_")})


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(message, name: str, payload: bytes) -> bytes:
    """One length-delimited field of `message`'s type, encoded by hand."""
    number = message.DESCRIPTOR.fields_by_name[name].number
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def deep_request_bytes(depth: int) -> bytes:
    """A GenerateRequest whose extra_args["a"] is `depth` nested lists (protobuf would refuse to
    build one this deep in memory, so it is encoded by hand)."""
    value = pb.JsonValue(int_value=1).SerializeToString()
    for _ in range(depth):
        value = _field(pb.JsonValue, "list_value", _field(pb.JsonList, "values", value))
    entry = _varint(1 << 3 | 2) + _varint(1) + b"a" + _varint(2 << 3 | 2) + _varint(len(value)) + value
    params = _field(pb.SamplingParams, "extra_args", entry)
    return _field(pb.GenerateRequest, "prompt", b"x") + _field(pb.GenerateRequest, "params", params)


def _depth(value) -> int:
    """Reference: nesting depth of a parsed JSON value."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}"\\,:'),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k[]{"', max_size=3), inner, max_size=3)
    ),
    max_leaves=30,
)


@given(json_values, st.integers(1, 8))
def test_depth_scan_equals_the_parsed_depth(value, limit):
    body = json.dumps(value).encode()
    assert json_depth_exceeds(body, limit) == (_depth(value) > limit)


def test_nesting_100k_deep_is_rejected_without_recursion():
    for depth in (100_000, 500):
        body = b'{"prompt":"x","vllm_xargs":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
        with pytest.raises(ValueError, match=r"limits.max_json_depth"):
            parse_json(Limits(max_body_bytes=10 << 20), body)
        body = b"[" * depth + b"]" * depth
        with pytest.raises(ValueError, match=r"limits.max_json_depth"):
            parse_json(Limits(max_body_bytes=10 << 20), body)
    assert sys.getrecursionlimit() < 100_000


def test_body_size_and_strict_json():
    with pytest.raises(PayloadTooLarge, match=r"limits.max_body_bytes") as err:
        parse_json(Limits(max_body_bytes=10), b'{"prompt": "0123456789"}')
    assert classify(err.value).http == 413
    for bad in (b'{"logit_bias": {"5": NaN}}', b'{"x": Infinity}', b'{"x": -Infinity}', b'{"x": 1e400}'):
        with pytest.raises(ValueError, match="body"):
            parse_json(LIMITS, bad)
    with pytest.raises(ValueError, match="body: invalid JSON"):
        parse_json(LIMITS, b"{not json")
    with pytest.raises(ValueError, match="UTF-8"):
        parse_json(LIMITS, b'{"prompt": "\xff"}')
    assert parse_json(LIMITS, b'{"prompt": "[{\\"x"}') == {"prompt": '[{"x'}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"model": "\\ud800"}', "model"),
        ('{"prompt": ["ok", "x\\udfff"]}', "prompt.1"),
        ('{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
        ('{"messages": [{"role": "\\udc00", "content": "x"}]}', "messages.0.role"),
        ('{"bad_words": ["\\ud800"]}', "bad_words.0"),
    ],
)
def test_lone_surrogates_are_named(body, field):
    with pytest.raises(ValueError, match="lone surrogate") as err:
        parse_json(LIMITS, body.encode())
    assert str(err.value).startswith(f"{field}: ")
    assert error_body(classify(err.value))["error"]["param"] == field
    # a proper pair is fine
    assert parse_json(LIMITS, b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}


@pytest.mark.parametrize(
    ("kw", "prompts", "limit"),
    [
        ({"n": 2000}, 1, "max_n"),
        ({}, 400, "max_prompts"),
        ({"stop": ["s"] * 33}, 1, "max_stop"),
        ({"stop": ["s" * 513]}, 1, "max_stop_chars"),
        ({"bad_words": ["w"] * 33}, 1, "max_stop"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, 1, "max_logit_bias"),
        ({"allowed_token_ids": list(range(LIMITS.max_allowed_token_ids + 1))}, 1, "max_allowed_token_ids"),
        ({"extra_args": {f"k{i}": i for i in range(10_000)}}, 1, "max_extra_args_keys"),
        ({"extra_args": {"a": "x" * 70_000}}, 1, "max_extra_args_bytes"),
    ],
)
def test_request_limits_name_the_limit(kw, prompts, limit):
    params = SamplingParams(**kw)
    with pytest.raises(ValueError, match=f"limits.{limit}") as err:
        check_request(LIMITS, params, prompts)
    status = classify(err.value)
    assert status.http == 400 and status.grpc == grpc.StatusCode.INVALID_ARGUMENT
    check_request(BIG, params, prompts)  # within larger limits


def _nested(depth: int) -> dict:
    deep: dict = {}
    node = deep
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return deep


def test_extra_args_depth_is_checked_without_recursion():
    with pytest.raises(ValueError, match=r"limits.max_extra_args_depth"):
        check_request(LIMITS, SamplingParams(extra_args=_nested(50)), 1)
    # Far past any limit, SamplingParams' own backstop answers first, still a ValueError.
    with pytest.raises(ValueError, match=r"^extra_args"):
        SamplingParams(extra_args=_nested(5000))
    check_request(LIMITS, SamplingParams(extra_args={"a": {"b": [1, {"c": 2}]}}), 1)


def test_limits_live_in_the_one_config():
    cfg = LogitpoolConfig.model_validate({"limits": {"max_n": 4, "read_timeout_s": 2.5}})
    assert cfg.limits.max_n == 4 and cfg.limits.max_body_bytes == Limits().max_body_bytes
    with pytest.raises(ValueError, match="max_nn"):
        LogitpoolConfig.model_validate({"limits": {"max_nn": 4}})
    with pytest.raises(ValueError, match="max_n"):
        LogitpoolConfig.model_validate({"limits": {"max_n": 0}})


def test_error_body_is_openai_shaped():
    body = error_body(classify(ValueError("n: 2000 completions exceeds limits.max_n (64)")))
    assert set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["param"] == "n" and body["error"]["code"] == 400
    assert error_body(classify(ValueError("body: invalid JSON")))["error"]["param"] is None


def test_responses_never_carry_nan_or_infinity():
    from cluster.openai.wire import dumps

    text = dumps({"logprob": -math.inf, "top": [math.nan, math.inf, 1.5], "ok": 2})
    assert json.loads(text) == {"logprob": -9999.0, "top": [None, 9999.0, 1.5], "ok": 2}
    assert "Infinity" not in text and "NaN" not in text


def test_the_proxy_defers_parsing_and_a_malformed_message_is_a_value_error():
    handler = grpc.unary_unary_rpc_method_handler(
        lambda r, c: None,
        request_deserializer=pb.GenerateRequest.FromString,
        response_serializer=pb.GenerateResponse.SerializeToString,
    )
    defer = _deferred(handler).request_deserializer
    raw = b"\xff\xff\xff\xff garbage"
    bad = defer(raw)
    assert isinstance(bad, WireRequest) and bad.raw == raw  # the proxy never parses
    with pytest.raises(ValueError) as err:
        bad.parse(pb.GenerateRequest)
    assert "logitpool.v1.GenerateRequest" in str(err.value) and "DecodeError" not in str(err.value)
    # nesting beyond protobuf's recursion limit is a decode error too
    with pytest.raises(ValueError, match="not a valid"):
        defer(deep_request_bytes(200)).parse(pb.GenerateRequest)
    shallow = defer(deep_request_bytes(10)).parse(pb.GenerateRequest)
    assert shallow.params.extra_args["a"].HasField("list_value")
    ok = defer(pb.GenerateRequest(prompt="hi").SerializeToString()).parse(pb.GenerateRequest)
    assert isinstance(ok, pb.GenerateRequest) and ok.prompt == "hi"
    with pytest.raises(ValueError, match=r"not a valid logitpool.v1.ListProcessorsRequest"):
        defer(b"").parse(pb.ListProcessorsRequest)  # a message of another method's type


def test_pool_snapshots_are_json_whatever_the_engine_reports():
    import torch

    from cluster import pool_stats
    from worker.async_engine import EngineStats

    stats = EngineStats(
        alive=True,
        heartbeat_age_s=0.1,
        num_running=2,
        num_waiting=1,
        finished={"stop": 3},
        restarts=1,
        kv={"blocks_used": torch.tensor(7), "hit_rate": float("nan"), "name": "x"},
    )
    snap = pool_stats.PoolSnapshot.of(stats, kv_cache_bytes=1024)
    wire = json.loads(snap.to_json())  # allow_nan=False inside: strict JSON or an error
    assert wire["kv"] == {"blocks_used": 7.0} and wire["finished"] == {"stop": 3} and wire["kv_cache_bytes"] == 1024
    back = pool_stats.PoolSnapshot.from_json(snap.to_json(), replica_id="r1")
    assert back == dataclasses.replace(snap, replica_id="r1")
    assert pool_stats.any_alive([snap]) and not pool_stats.any_alive([dataclasses.replace(snap, alive=False)])
    for bad in ("[]", '{"alive": true}', "not json"):  # a malformed entry is an error the reader skips
        with pytest.raises((TypeError, ValueError)):
            pool_stats.PoolSnapshot.from_json(bad)


def test_metrics_sum_the_pool_and_keep_per_replica_kv():
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics import Metrics
    from cluster.pool_stats import PoolSnapshot

    pool = [
        PoolSnapshot(
            replica_id="a",
            alive=True,
            num_running=2,
            num_waiting=1,
            finished={"stop": 3, "error": 1},
            restarts=1,
            kv={"blocks_used": 5.0},
            kv_cache_bytes=100,
            heartbeat_age_s=0.2,
        ),
        PoolSnapshot(
            replica_id="b",
            alive=False,
            num_running=1,
            num_waiting=0,
            finished={"stop": 4, "abort": 2},
            restarts=0,
            kv={},
            kv_cache_bytes=50,
            heartbeat_age_s=70.0,
        ),
    ]
    m = Metrics(model_name="m", max_model_len=64)
    m.reject("http", 413)
    body, _ = m.render(pool)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }
    assert samples[("logitpool_worker_replicas", (("state", "alive"),))] == 1
    assert samples[("logitpool_worker_replicas", (("state", "dead"),))] == 1
    assert samples[("logitpool_running_sequences", ())] == 3 and samples[("logitpool_waiting_sequences", ())] == 1
    assert samples[("logitpool_sequences_finished_total", (("reason", "stop"),))] == 7
    assert samples[("logitpool_sequences_finished_total", (("reason", "abort"),))] == 2
    assert samples[("logitpool_engine_restarts_total", ())] == 1
    assert samples[("logitpool_kv_cache", (("replica", "a"), ("stat", "blocks_used")))] == 5
    assert samples[("logitpool_kv_cache", (("replica", "b"), ("stat", "bytes")))] == 50
    rejected = (("ingress", "local"), ("protocol", "http"), ("status", "413"))
    assert samples[("logitpool_requests_rejected_total", rejected)] == 1


# -- UTF-8 only (issue 17, item 8) -----------------------------------------------------------


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_json_in_another_encoding_is_415(encoding):
    """json.loads(bytes) would decode these (RFC 4627 detection) and the byte-level surrogate scan
    would not see the escapes inside: the issue's way to a lone surrogate in a constraint."""
    from cluster.limits import UnsupportedMediaType

    for text in ('{"structured_outputs": {"regex": "\\ud800"}}', '{"prompt": "x", "model": "\\udfff"}', "{}"):
        with pytest.raises(UnsupportedMediaType, match=r"^body: JSON must be UTF-8") as err:
            parse_json(LIMITS, text.encode(encoding))
        assert classify(err.value).http == 415


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
        max_leaves=12,
    ),
    st.sampled_from(["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be", "utf-16", "utf-32"]),
)
def test_no_json_value_is_accepted_in_another_encoding(value, encoding):
    from cluster.limits import UnsupportedMediaType

    text = json.dumps(value)
    assert parse_json(LIMITS, text.encode("utf-8")) == value
    assert parse_json(LIMITS, b"\xef\xbb\xbf" + text.encode("utf-8")) == value  # a UTF-8 BOM is skipped
    with pytest.raises(ValueError) as err:
        parse_json(LIMITS, text.encode(encoding))
    assert isinstance(err.value, UnsupportedMediaType) or "UTF-8" in str(err.value)


def test_bytes_that_are_not_utf8_are_400_naming_the_body():
    for bad in (b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\xc0\xaf"}', b'{"prompt": "\xff"}'):
        with pytest.raises(ValueError, match=r"^body: not valid UTF-8") as err:
            parse_json(LIMITS, bad)
        assert classify(err.value).http == 400


@pytest.mark.parametrize(
    ("content_type", "charset"),
    [
        ("application/json", None),
        ("application/json; charset=utf-8", "utf-8"),
        ('application/json;Charset="UTF-16"', "utf-16"),
        ("application/json; foo=bar; charset=latin-1", "latin-1"),
    ],
)
def test_content_type_charset(content_type, charset):
    from cluster.openai.wire import charset as parse_charset

    assert parse_charset(content_type) == charset


# -- the response a request may ask for (issue 17, item 2) -----------------------------------


def _position(tok: int, k: int):
    from worker.outputs import Logprob

    return {t: Logprob(-1.0, r + 1, f"<{t}>") for r, t in enumerate(range(tok, tok + k + 1))}


def _outputs(prompts: int, n: int, length: int, generated: int, k: int | None, kp: int | None):
    from worker.outputs import CompletionOutput, RequestOutput

    outs = []
    for _ in range(prompts):
        plp = None if kp is None else [None] + [_position(t, kp) for t in range(1, length)]
        choices = [
            CompletionOutput(
                i,
                "x" * generated,
                [7] * generated,
                -1.0,
                None if k is None else [_position(7, k) for _ in range(generated)],
                "length",
            )
            for i in range(n)
        ]
        outs.append(RequestOutput("r", None, list(range(length)), choices, True, prompt_logprobs=plp))
    return outs


def _entries(body: dict) -> int:
    """Logprob entries in a completions response, counted in its JSON: the reference."""
    total = 0
    for choice in body["choices"]:
        positions = (choice.get("prompt_logprobs") or []) + ((choice["logprobs"] or {}).get("top_logprobs") or [])
        total += sum(len(p) for p in positions if p is not None)
    return total


@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(1, 5),
    st.none() | st.integers(0, 3),
    st.none() | st.integers(0, 3),
    st.booleans(),
)
def test_response_estimate_bounds_the_response_it_describes(prompts, n, length, generated, k, kp, echo):
    """The estimate against the entries a real completions response carries (built by the
    protocol's own code): never fewer; more only by the prompts' first positions (no logprob)."""
    from cluster.limits import ResponseShape, response_logprobs
    from cluster.openai.protocol import Echo, completion_response

    params = SamplingParams(n=n, max_tokens=generated, logprobs=k, prompt_logprobs=kp)
    outs = _outputs(prompts, n, length, generated, k, kp)
    echoes = [Echo("p", list(range(length)), out.prompt_logprobs) for out in outs] if echo else None
    body = json.loads(json.dumps(completion_response("id", "m", outs, str, echoes=echoes)))
    estimate = response_logprobs(params, [length] * prompts, 10_000, ResponseShape(True, echo))
    actual = _entries(body)
    first = 0 if kp is None else prompts * (n + (n if echo and k is not None else 0)) * (kp + 1)
    assert actual <= estimate <= actual + first


def test_the_issues_amplifying_request_is_refused_before_admission():
    """64 prompts x n 64 with prompt logprobs (the 584 MB response): a 400 naming the limit."""
    from cluster.limits import ResponseShape, check_response

    params = SamplingParams(n=64, max_tokens=16, logprobs=5, prompt_logprobs=5)
    with pytest.raises(ValueError, match=r"limits\.max_response_logprobs \(1048576\)") as err:
        check_response(LIMITS, params, [100] * 64, 2048, ResponseShape(True, echo=True))
    assert error_body(classify(err.value))["error"]["param"] == "prompt_logprobs"
    check_response(
        LIMITS,
        SamplingParams(n=1, max_tokens=16, logprobs=5, prompt_logprobs=5),
        [2000],
        2048,
        ResponseShape(True, echo=True),
    )  # lm-eval's loglikelihood shape: one long prompt


def test_choices_share_their_prompts_logprobs():
    """Converted once per prompt, the same list in each of its n choices (not n copies)."""
    from cluster.openai.protocol import completion_choices

    choices = list(completion_choices(_outputs(2, 3, 4, 1, None, 2), str))
    assert len(choices) == 6
    assert all(c["prompt_logprobs"] is choices[0]["prompt_logprobs"] for c in choices[:3])
    assert choices[3]["prompt_logprobs"] is not choices[0]["prompt_logprobs"]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=10,
)


@given(
    st.dictionaries(st.text(max_size=6), _json_values, max_size=3),
    st.lists(_json_values, max_size=8),
    st.dictionaries(st.text(max_size=6), _json_values, max_size=3),
    st.integers(1, 200),
)
def test_a_response_written_in_pieces_is_the_same_bytes(head, items, tail, chunk_bytes):
    from cluster.openai.wire import dumps, json_chunks

    head.pop("choices", None)
    tail = {k: v for k, v in tail.items() if k not in head and k != "choices"}
    pieces = list(json_chunks(head, "choices", iter(items), lambda: tail, chunk_bytes))
    assert b"".join(pieces) == dumps({**head, "choices": items, **tail}).encode("utf-8")
    # a piece: up to chunk_bytes, plus the item that crossed it, plus the head or the tail
    item = max((len(dumps(i).encode()) for i in items), default=0)
    edges = len(dumps(head).encode()) + len(dumps(tail).encode()) + len("choices") + 8
    assert all(len(p) <= chunk_bytes + item + edges for p in pieces)
