"""Unit tests without Ray for the pieces both adapters share: API keys, the one error mapping,
gRPC <-> worker conversion and the OpenAI body -> SamplingParams conversion. Each batched or
table-driven conversion is checked against a plain reference, field by field."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError

from client.convert import completion_from_pb, sampling_params_to_pb
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.auth import ApiKeys, Unauthenticated
from cluster.errors import ModelNotFound, RequestFailed, classify, error_body, replica_unavailable
from cluster.limits import PayloadTooLarge
from cluster.openai.protocol import CompletionRequest
from cluster.rpc.convert import delta_pb, prompt_from_pb, response_pb, sampling_params_from_pb
from worker.async_engine import EngineDeadError
from worker.outputs import CompletionOutput, Logprob, RequestOutput
from worker.sampling_params import SamplingParams

_key = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=24)


# ---- auth ----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(_key, min_size=1, max_size=3), given_key=_key)
def test_api_keys_accept_exactly_a_configured_bearer_key(keys: list[str], given_key: str) -> None:
    auth = ApiKeys(keys)
    for k in keys:
        auth.check(f"Bearer {k}")
    if given_key not in keys:
        with pytest.raises(Unauthenticated, match="invalid API key"):
            auth.check(f"Bearer {given_key}")
    for header in (None, "", given_key, f"Basic {keys[0]}"):
        with pytest.raises(Unauthenticated):
            auth.check(header)


@pytest.mark.parametrize("header", ["Bearer k1", "bearer k1", "  BEARER   k1  "])
def test_a_key_accepted_in_any_spelling_is_one_tenant(header: str) -> None:
    """The fair scheduler's tenant is the key ApiKeys accepted, however the scheme was written."""
    from cluster.frontend import tenant_id

    ApiKeys(["k1"]).check(header)
    assert tenant_id(header) == tenant_id("Bearer k1") != tenant_id("Bearer k2")


def test_no_keys_means_auth_off() -> None:
    assert not ApiKeys([]).enabled and not ApiKeys(["", ""]).enabled
    ApiKeys([]).check(None)
    ApiKeys([]).check("Bearer anything")


# ---- errors: one mapping for both protocols ------------------------------------------------------


def _validation_error() -> ValidationError:
    try:
        CompletionRequest.model_validate({"prompt": "x", "n": "many"})
    except ValidationError as exc:
        return exc
    raise AssertionError("no error")


@pytest.mark.parametrize(
    ("exc", "http", "code", "kind"),
    [
        (Unauthenticated("missing API key"), 401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error"),
        (ModelNotFound("gpt-9"), 404, grpc.StatusCode.NOT_FOUND, "NotFoundError"),
        (ValueError("temperature: must be >= 0"), 400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error"),
        (PayloadTooLarge("body: too big"), 413, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error"),
        (
            BackPressureError(num_queued_requests=3, max_queued_requests=2),
            503,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "overloaded",
        ),
        (EngineDeadError("gone"), 503, grpc.StatusCode.UNAVAILABLE, "unavailable"),
        (TimeoutError("r1"), 504, grpc.StatusCode.DEADLINE_EXCEEDED, "timeout"),
        (RequestFailed("processor X failed"), 500, grpc.StatusCode.INTERNAL, "request_failed"),
        (KeyError("bug"), 500, grpc.StatusCode.INTERNAL, "internal_error"),
    ],
)
def test_classify_maps_each_error_once(exc: BaseException, http: int, code: grpc.StatusCode, kind: str) -> None:
    status = classify(exc)
    assert (status.http, status.grpc, status.kind) == (http, code, kind)
    body = error_body(status)["error"]
    assert body["code"] == http and body["type"] == kind
    if kind == "internal_error":
        assert body["message"] == "internal error"  # no internals leak


def test_validation_errors_name_the_field() -> None:
    status = classify(_validation_error())
    assert status.http == 400 and status.message.startswith("n: ")
    assert error_body(status)["error"]["param"] == "n"


def test_a_worker_side_error_is_classified_by_its_cause() -> None:
    wrapped = RayTaskError("generate", "traceback", ValueError("max_tokens: too many"))
    assert classify(wrapped).http == 400
    dead = RayTaskError("generate", "traceback", EngineDeadError("x"))
    assert replica_unavailable(dead) and not replica_unavailable(ValueError("x"))


@given(field=st.from_regex(r"[a-z_][a-z0-9_.]{0,20}", fullmatch=True), rest=st.text(max_size=30))
def test_param_is_the_field_a_message_names_first(field: str, rest: str) -> None:
    body = error_body(classify(ValueError(f"{field}: {rest}")))["error"]
    assert body["param"] == (None if field in ("body", "request") else field)
    assert error_body(classify(ValueError("no field here")))["error"]["param"] is None


# ---- gRPC conversion -----------------------------------------------------------------------------

_sampling = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 4),
        "temperature": st.floats(0, 2, width=32),
        "top_p": st.floats(0.125, 1, width=32),
        "top_k": st.integers(0, 50),
        "max_tokens": st.integers(1, 100),
        "min_tokens": st.integers(0, 5),
        "seed": st.integers(0, 2**31),
        "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 100), max_size=3),
        "ignore_eos": st.booleans(),
        "logit_bias": st.dictionaries(st.integers(0, 100), st.floats(-100, 100, width=32), max_size=3),
        "extra_args": st.dictionaries(
            st.text(min_size=1, max_size=5), st.integers(-5, 5) | st.text(max_size=5), max_size=3
        ),
    },
).filter(lambda d: d.get("min_tokens", 0) <= d.get("max_tokens", SamplingParams().max_tokens))  # a valid request


@settings(max_examples=80, deadline=None)
@given(fields=_sampling)
def test_sampling_params_survive_the_wire(fields: dict) -> None:
    """client kwargs -> pb -> server SamplingParams equals SamplingParams(**kwargs) (the reference)."""
    got = sampling_params_from_pb(sampling_params_to_pb(fields))
    # On the wire an empty map is an unset one.
    ref = {k: v for k, v in fields.items() if not (k in ("logit_bias", "extra_args") and not v)}
    assert got == SamplingParams(**ref)


def test_prompt_oneof() -> None:
    assert prompt_from_pb(pb.GenerateRequest(prompt="hi")) == "hi"
    assert prompt_from_pb(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2]))) == [1, 2]
    with pytest.raises(ValueError, match=r"^prompt: "):
        prompt_from_pb(pb.GenerateRequest())


def _output(tokens: list[int], finished: bool) -> RequestOutput:
    logprobs = [{t: Logprob(-0.5, 1), t + 1: Logprob(-1.5, 2)} for t in tokens]
    c = CompletionOutput(
        index=0,
        text="".join(f"<{t}>" for t in tokens),
        token_ids=tokens,
        cumulative_logprob=-1.0,
        logprobs=logprobs,
        finish_reason="length" if finished else None,
    )
    return RequestOutput("r", None, [9, 9, 9], [c], finished=finished)


def test_response_and_delta_carry_tokens_logprobs_and_usage() -> None:
    decode = lambda t: f"<{t}>"
    resp = completion_from_pb(response_pb("client-id", _output([4, 5], True), decode))
    assert resp.request_id == "client-id"
    (choice,) = resp.choices
    assert choice.token_ids == (4, 5) and choice.text == "<4><5>" and choice.finish_reason == "length"
    assert [lp.token for lp in choice.logprobs] == ["<4>", "<5>"]
    assert [[t.token_id for t in lp.top] for lp in choice.logprobs] == [[4, 5], [5, 6]]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (3, 2)
    delta = delta_pb("client-id", _output([7], False), decode)
    assert list(delta.deltas[0].token_ids) == [7] and not delta.HasField("usage")


# ---- OpenAI body -> SamplingParams ---------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    temperature=st.none() | st.floats(0, 2),
    top_p=st.none() | st.floats(0.01, 1),
    max_tokens=st.none() | st.integers(1, 500),
    stop=st.none() | st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
    xargs=st.none() | st.dictionaries(st.text(min_size=1, max_size=4), st.integers(), max_size=2),
)
def test_completion_body_to_params(temperature, top_p, max_tokens, stop, xargs) -> None:
    body = {
        "prompt": "p",
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "stop": stop,
        "vllm_xargs": xargs,
    }
    params = CompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}).sampling_params()
    ref = SamplingParams()  # the plain reference: a field left out takes SamplingParams' default
    assert params.temperature == (ref.temperature if temperature is None else temperature)
    assert params.top_p == (ref.top_p if top_p is None else top_p)
    assert params.max_tokens == (16 if max_tokens is None else max_tokens)  # OpenAI's completion default
    assert params.stop == ([] if stop is None else [stop] if isinstance(stop, str) else stop)
    assert (params.extra_args or None) == (xargs or None)
