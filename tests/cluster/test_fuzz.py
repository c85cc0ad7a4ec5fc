"""Fuzzing a live deployment: schemathesis over the OpenAPI document (HTTP) and a hypothesis
fuzzer over every field of the gRPC request (extreme values, generated from the proto's
descriptors, so a new field is fuzzed without touching this file). Both assert that nothing
is a server error: every answer is a valid result or a 4xx / INVALID_ARGUMENT (NOT_FOUND for
an unknown `model`) naming the problem, without internal class names. Budgets are bounded (max_model_len 64 bounds every
generation; example counts are fixed)."""

from __future__ import annotations

import math

import grpc
import hypothesis.strategies as st
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, event, example, given, settings

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.cli.bench_soak import nested_extra_args_request
from cluster.config import LogitpoolConfig

pytestmark = pytest.mark.ray

APP = "fuzz"
MAX_DEPTH = 3

INT32 = [-(2**31), -1, 0, 1, 2, 5, 16, 2999, 3000, 2**31 - 1]
INT64 = [-(2**63), -(2**31), -1, 0, 1, 2**31, 2**63 - 1]
DOUBLES = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-300, 1e308, -1e308, 0.5, 1.0, 2.0, 100.0, -100.0]
STRINGS = ["", "x", "raw_logprobs", "processed_logprobs", "processed_logits", "\x00", "é😀\u202e", "a" * 5000]


def _scalar(f: FieldDescriptor) -> st.SearchStrategy:
    t = f.type
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.one_of(st.sampled_from(INT32), st.integers(0, 64), st.integers(-(2**31), 2**31 - 1))
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return st.one_of(st.sampled_from(INT64), st.integers(-(2**63), 2**63 - 1))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(DOUBLES), st.floats(0, 2), st.floats())
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(STRINGS), st.text(max_size=40))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    raise AssertionError(f"unhandled field type {t} of {f.full_name}")


def _is_map(f: FieldDescriptor) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


@st.composite
def messages(draw: st.DrawFn, desc: Descriptor, depth: int = 0, density: float | None = None):
    """Any message of ``desc``: each field set or not, with extreme values; nesting bounded.

    ``density`` is the chance that a field is set, drawn once per request: sparse requests (one
    or two extreme fields, the rest valid defaults) reach the engine; dense ones test validation.
    """
    if density is None:
        density = draw(st.sampled_from([0.02, 0.05, 0.15, 0.5]))
    msg = message_factory.GetMessageClass(desc)()
    skip = set()
    for oneof in desc.oneofs:
        fields = list(oneof.fields)
        if len(fields) == 1 and oneof.name == "_" + fields[0].name:
            continue  # proto3 `optional`: a synthetic oneof, set or not by density like any field
        # Rarely none at all (the request then lacks its prompt, a JSON value its kind).
        chosen = None if draw(st.integers(0, 19)) == 0 else draw(st.sampled_from(fields))
        skip |= {f.name for f in fields if f is not chosen}
    for f in desc.fields:
        real_oneof = f.containing_oneof is not None and f.containing_oneof.name != "_" + f.name
        if f.name in skip or (not real_oneof and draw(st.floats(0, 1)) >= density):
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE and depth >= MAX_DEPTH:
            continue
        container = getattr(msg, f.name) if (f.is_repeated or f.type == FieldDescriptor.TYPE_MESSAGE) else None
        if _is_map(f):
            key_f, value_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 4))):
                key = draw(_scalar(key_f))
                if value_f.type == FieldDescriptor.TYPE_MESSAGE:
                    container[key].CopyFrom(draw(messages(value_f.message_type, depth + 1, 0.5)))
                else:
                    container[key] = draw(_scalar(value_f))
        elif f.is_repeated and f.type == FieldDescriptor.TYPE_MESSAGE:
            for _ in range(draw(st.integers(0, 3))):
                container.add().CopyFrom(draw(messages(f.message_type, depth + 1, 0.5)))
        elif f.is_repeated:
            container.extend(draw(st.lists(_scalar(f), max_size=6)))
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            sub_density = density if desc.full_name.endswith("GenerateRequest") else 0.5
            container.CopyFrom(draw(messages(f.message_type, depth + 1, sub_density)))
            container.SetInParent()  # set even when empty (an empty TokenIds is not "unset")
        else:
            setattr(msg, f.name, draw(_scalar(f)))
    return msg


@pytest.fixture(scope="module")
def fuzz_target(serve_ports, tiny_model_dir):
    """A deployment with only the built-in processors: any server error is then a bug."""
    from ray import serve

    from cluster.cli.launch import wait_ready
    from tests.cluster.serving_helpers import deploy

    cfg = LogitpoolConfig.model_validate(
        {
            "engine": {"model": str(tiny_model_dir), "max_num_seqs": 16, "max_model_len": 64},
            "workers": {"num_replicas": 1, "num_cpus": 1},
            "server": {"http_port": serve_ports[0], "grpc_port": serve_ports[1]},
            "app_name": APP,
        }
    )
    cfg = deploy(cfg)
    wait_ready("127.0.0.1", cfg.server.http_port, timeout_s=180)
    yield cfg
    serve.delete(APP)


@pytest.fixture(scope="module")
def channel(fuzz_target):
    with grpc.insecure_channel(f"127.0.0.1:{fuzz_target.server.grpc_port}") as ch:
        yield ch


FINISHED = {"length", "stop"}


def _reach_the_engine(request: pb.GenerateRequest) -> None:
    """Half the requests get an ordinary prompt, so that their other fields, not an unusable
    prompt, decide the outcome (derived from the request, so hypothesis still shrinks it)."""
    if request.ByteSize() % 2 == 0:
        request.prompt = "def main("


def _check_status(err: grpc.RpcError) -> None:
    code, details = err.code(), err.details() or ""
    event(f"{code.name}: {details.split(':')[0][:40]}")
    # NOT_FOUND only for a `model` other than the served one (HTTP's 404)
    assert code == grpc.StatusCode.INVALID_ARGUMENT or (
        code == grpc.StatusCode.NOT_FOUND and details.startswith("model: ")
    ), f"{code}: {details}"
    assert details and "Traceback" not in details and "<class" not in details, details


def _check_completion(c: pb.Completion | pb.CompletionDelta) -> None:
    assert not c.error, c.error
    for pos in c.logprobs:
        assert math.isfinite(pos.logprob) and all(math.isfinite(t.logprob) for t in pos.top), pos


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=messages(pb.GenerateRequest.DESCRIPTOR))
@example(request=pb.GenerateRequest(prompt="x", params=pb.SamplingParams(max_tokens=3, logit_bias={67: 1e308})))
@example(request=pb.GenerateRequest(prompt="x", params=pb.SamplingParams(max_tokens=3, repetition_penalty=1e-300)))
@example(
    request=pb.GenerateRequest(
        prompt="x",
        params=pb.SamplingParams(
            max_tokens=3, logprobs=3, logprobs_mode="processed_logprobs", allowed_token_ids=pb.TokenIds(ids=[5, 6])
        ),
    )
)
def test_grpc_generate_fuzz(channel, request):
    """Every field at extreme values: a valid answer or INVALID_ARGUMENT, never another code."""
    _reach_the_engine(request)
    call = channel.unary_unary(
        "/logitpool.v1.LogitPool/Generate",
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    try:
        response = call(request, timeout=60)
    except grpc.RpcError as err:
        _check_status(err)
        return
    assert response.completions
    event("OK")
    for c in response.completions:
        assert c.finish_reason in FINISHED, (c.finish_reason, c.error)
        _check_completion(c)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=messages(pb.GenerateRequest.DESCRIPTOR))
def test_grpc_stream_fuzz(channel, request):
    _reach_the_engine(request)
    call = channel.unary_stream(
        "/logitpool.v1.LogitPool/GenerateStream",
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateStreamResponse.FromString,
    )
    try:
        finished = [
            d.finish_reason
            for msg in call(request, timeout=60)
            for d in msg.deltas
            if (_check_completion(d) or True) and d.finish_reason
        ]
    except grpc.RpcError as err:
        _check_status(err)
        return
    assert finished and set(finished) <= FINISHED, finished


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.one_of(st.binary(max_size=256), st.sampled_from([b"\xff" * 8, b"\x0a\xff\xff\xff\xff\x0f", b"\x22\x05"])))
@example(raw=nested_extra_args_request(60))
@example(raw=nested_extra_args_request(500))
def test_grpc_garbage_bytes(channel, raw):
    """Malformed protobuf is INVALID_ARGUMENT without internal class names (or, when the bytes
    happen to decode, an ordinary answer)."""
    call = channel.unary_unary("/logitpool.v1.LogitPool/Generate")  # bytes in, bytes out
    try:
        pb.GenerateResponse.FromString(call(raw, timeout=60))
    except grpc.RpcError as err:
        _check_status(err)


# -- HTTP: schemathesis over the served OpenAPI document -----------------------------------
# Driven through schemathesis' Python API with hypothesis' own @given (its pytest plugin does not
# run under pytest 9): every operation, positive and negative generation modes.

import schemathesis  # noqa: E402 - the HTTP half's imports, kept with it
from schemathesis import GenerationMode  # noqa: E402 - as above
from schemathesis.checks import (  # noqa: E402 - as above
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

HTTP_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
HTTP_EXAMPLES = 25  # per operation and mode


@pytest.fixture(scope="module")
def openapi_schema(fuzz_target):
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{fuzz_target.server.http_port}/openapi.json")


def test_http_schemathesis(openapi_schema):
    """Generated requests (valid and invalid by the declared schema) never give a server error, and
    every response matches what the document declares (status, content type, body schema)."""
    operations = [result.ok() for result in openapi_schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= labels, labels
    for op in operations:
        # Negative generation needs something to break: the request bodies (GETs take no input).
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:

            @settings(
                max_examples=HTTP_EXAMPLES,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                case.call_and_validate(checks=HTTP_CHECKS, timeout=60)

            run()
