"""Every conversion between the client's Python values and the wire (protobuf, metadata).

The one place on the client side that touches generated messages, so the wire schema can change
without the rest of the client noticing. The JSON helpers are public for the server, which must
decode ``extra_args`` the same way (``json_from_pb`` / ``extra_args_from_pb``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import replace
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from client.errors import InternalError
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from client.types import Choice, Chunk, Completion, Logprob, ProcessorInfo, TokenLogprobs, Usage

# ---------------------------------------------------------------------------------------------
# JSON values (extra_args): every type kept exactly; ints stay ints.


def json_to_pb(value: object) -> pb.JsonValue:
    """A JSON-compatible Python value as a JsonValue. TypeError for anything JSON cannot hold."""
    msg = pb.JsonValue()
    _fill(msg, value)
    return msg


def json_from_pb(msg: pb.JsonValue) -> Any:
    """The Python value of a JsonValue: None, bool, int, float, str, list or dict."""
    kind = msg.WhichOneof("kind")
    if kind == "null_value":
        return None
    if kind in ("bool_value", "int_value", "double_value", "string_value"):
        return getattr(msg, kind)
    if kind == "list_value":
        return [json_from_pb(v) for v in msg.list_value.values]
    if kind == "object_value":
        return extra_args_from_pb(msg.object_value.fields)
    raise ValueError("JsonValue has no value set")


def extra_args_from_pb(fields: Mapping[str, pb.JsonValue]) -> dict[str, Any]:
    """A ``map<string, JsonValue>`` (SamplingParams.extra_args, JsonObject.fields) as a dict."""
    return {key: json_from_pb(value) for key, value in fields.items()}


def _fill(msg: pb.JsonValue, value: object) -> None:
    # bool before int: bool is an int subclass, and True must not become 1.
    if value is None:
        msg.null_value = pb.JSON_NULL
    elif isinstance(value, bool):
        msg.bool_value = value
    elif isinstance(value, int):
        msg.int_value = value  # ValueError outside int64
    elif isinstance(value, float):
        msg.double_value = value
    elif isinstance(value, str):
        msg.string_value = value
    elif isinstance(value, Mapping):
        msg.object_value.SetInParent()
        _fill_object(msg.object_value.fields, value)
    elif isinstance(value, (list, tuple)):
        msg.list_value.SetInParent()
        for item in value:
            _fill(msg.list_value.values.add(), item)
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")


def _fill_object(fields: MutableMapping[str, pb.JsonValue], value: Mapping[object, object]) -> None:
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"JSON object keys must be strings, got {key!r}")
        _fill(fields[key], item)


# ---------------------------------------------------------------------------------------------
# Structured outputs: {"json": schema | str} / {"regex": str} / {"choice": [str]} /
# {"grammar": str} / {"json_object": True}, as vLLM's `structured_outputs` (shared with the server).

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_to_pb(value: Mapping[str, Any]) -> pb.StructuredOutputs:
    """TypeError/ValueError unless ``value`` holds exactly one known kind."""
    if not isinstance(value, Mapping):
        raise TypeError(f"must be a dict with one of {', '.join(STRUCTURED_KINDS)}, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None}
    unknown = sorted(set(given) - set(STRUCTURED_KINDS))
    if unknown or len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)}, got {sorted(given)}")
    ((kind, v),) = given.items()
    msg = pb.StructuredOutputs()
    if kind == "json":
        msg.json = v if isinstance(v, str) else json.dumps(v)
    elif kind == "choice":
        msg.choice.choices.extend(v)
    else:
        setattr(msg, kind, v)
    return msg


def structured_outputs_from_pb(msg: pb.StructuredOutputs) -> dict[str, Any]:
    """The dict form; empty when no kind is set (the server rejects that)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return {}
    if kind == "choice":
        return {"choice": list(msg.choice.choices)}
    return {kind: getattr(msg, kind)}


# ---------------------------------------------------------------------------------------------
# Requests

SAMPLING_FIELDS: frozenset[str] = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def sampling_params_to_pb(sampling: Mapping[str, Any]) -> pb.SamplingParams:
    """Keyword arguments named as SamplingParams' fields → the message. None leaves a field unset.

    An unknown name raises TypeError before anything is sent; a value of the wrong type raises
    TypeError/ValueError naming the field. Range checks are the server's (one set of rules).
    """
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(SAMPLING_FIELDS))}"
        )
    msg = pb.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        try:
            _set_sampling_field(msg, name, value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from exc
    return msg


def _set_sampling_field(msg: pb.SamplingParams, name: str, value: Any) -> None:
    if name == "extra_args":
        if not isinstance(value, Mapping):
            raise TypeError(f"must be a dict, got {type(value).__name__}")
        _fill_object(msg.extra_args, value)
    elif name == "structured_outputs":
        msg.structured_outputs.CopyFrom(structured_outputs_to_pb(value))
    elif name == "logit_bias":
        for token, bias in value.items():
            msg.logit_bias[int(token)] = bias  # JSON-style string keys are accepted, as on HTTP
    elif name == "allowed_token_ids":
        msg.allowed_token_ids.SetInParent()  # an empty list is sent as such (and rejected)
        msg.allowed_token_ids.ids.extend(value)
    elif name == "stop" and isinstance(value, str):
        msg.stop.append(value)
    elif pb.SamplingParams.DESCRIPTOR.fields_by_name[name].is_repeated:
        getattr(msg, name).extend(value)
    else:
        setattr(msg, name, value)


def generate_request(
    prompt: str | Iterable[int],
    sampling: Mapping[str, Any],
    *,
    request_id: str | None = None,
    model: str | None = None,
    add_special_tokens: bool | None = None,
) -> pb.GenerateRequest:
    """One GenerateRequest from a prompt (text or token ids) and sampling keywords;
    ``add_special_tokens``: None leaves the server's default (true)."""
    req = pb.GenerateRequest(params=sampling_params_to_pb(sampling))
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray, Mapping)):
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(prompt)
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    if request_id is not None:
        req.request_id = request_id
    if model is not None:
        req.model = model
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def list_processors_request() -> pb.ListProcessorsRequest:
    return pb.ListProcessorsRequest()


def call_metadata(api_key: str | None, application: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata sent with every call: the API key, and the Ray Serve application to route to."""
    metadata: list[tuple[str, str]] = []
    if api_key is not None:
        metadata.append(("authorization", f"Bearer {api_key}"))
    if application is not None:
        metadata.append(("application", application))
    return tuple(metadata)


# ---------------------------------------------------------------------------------------------
# Responses


def _usage(msg: pb.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.total_tokens, msg.cached_tokens)


def _logprobs(positions: Sequence[pb.PositionLogprobs]) -> tuple[TokenLogprobs, ...]:
    return tuple(
        TokenLogprobs(
            token_id=p.token_id,
            logprob=p.logprob,
            rank=p.rank,
            token=p.token,
            top=tuple(Logprob(t.token_id, t.logprob, t.rank, t.token) for t in p.top),
        )
        for p in positions
    )


def _prompt_logprobs(msg: pb.GenerateResponse | pb.GenerateStreamResponse) -> tuple[TokenLogprobs | None, ...] | None:
    """The response's prompt logprobs, the first prompt token's None put back; None when unset."""
    if not msg.HasField("prompt_logprobs"):
        return None
    return (None, *_logprobs(msg.prompt_logprobs.positions))


def _choice(c: pb.Completion) -> Choice:
    return Choice(
        index=c.index,
        text=c.text,
        token_ids=tuple(c.token_ids),
        finish_reason=c.finish_reason or None,
        logprobs=_logprobs(c.logprobs),
        cumulative_logprob=c.cumulative_logprob if c.HasField("cumulative_logprob") else None,
        error=c.error or None,
    )


def completion_from_pb(resp: pb.GenerateResponse) -> Completion:
    choices = tuple(sorted((_choice(c) for c in resp.completions), key=lambda c: c.index))
    if not choices:
        raise InternalError("the server returned no completions")
    first = choices[0]
    return Completion(
        request_id=resp.request_id,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=first.finish_reason,
        logprobs=first.logprobs,
        usage=_usage(resp.usage),
        choices=choices,
        cumulative_logprob=first.cumulative_logprob,
        error=first.error,
        prompt_logprobs=_prompt_logprobs(resp),
    )


def chunks_from_pb(resp: pb.GenerateStreamResponse) -> list[Chunk]:
    """One Chunk per delta; the message's usage goes on its last chunk (alone if it has none)."""
    chunks = [
        Chunk(
            index=d.index,
            text=d.text,
            token_ids=tuple(d.token_ids),
            finish_reason=d.finish_reason or None,
            logprobs=_logprobs(d.logprobs),
            request_id=resp.request_id,
            error=d.error or None,
        )
        for d in resp.deltas
    ]
    plp = _prompt_logprobs(resp)
    if plp is not None:
        if not chunks:
            chunks.append(Chunk(index=0, text="", token_ids=(), request_id=resp.request_id))
        chunks[0] = replace(chunks[0], prompt_logprobs=plp)
    if resp.HasField("usage"):
        usage = _usage(resp.usage)
        if chunks:
            chunks[-1] = replace(chunks[-1], usage=usage)
        else:
            chunks.append(Chunk(index=0, text="", token_ids=(), usage=usage, request_id=resp.request_id))
    return chunks


def processors_from_pb(resp: pb.ListProcessorsResponse) -> list[ProcessorInfo]:
    infos = []
    for p in resp.processors:
        schema = None
        if p.HasField("extra_args_schema_json"):
            try:
                schema = json.loads(p.extra_args_schema_json)
            except ValueError as exc:
                raise InternalError(f"processor {p.name}: the server sent an invalid JSON schema ({exc})") from exc
        infos.append(ProcessorInfo(p.name, p.fqcn, p.argmax_invariant, tuple(p.extra_args_keys), schema))
    return infos


# ---------------------------------------------------------------------------------------------
# grpc.health.v1 without grpcio-health-checking (the client depends on grpcio + protobuf only).
# The two messages are rebuilt in a private descriptor pool, so they never clash with
# grpc_health's own registration when both live in one process (the server).

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
_SERVING = 1


def _health_messages() -> tuple[Any, Any]:  # classes built at run time: no static fields
    fdp = descriptor_pb2.FileDescriptorProto(
        name="logitpool_client/grpc_health_v1.proto", package="grpc.health.v1", syntax="proto3"
    )
    string, int32 = descriptor_pb2.FieldDescriptorProto.TYPE_STRING, descriptor_pb2.FieldDescriptorProto.TYPE_INT32
    optional = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    fdp.message_type.add(name="HealthCheckRequest").field.add(name="service", number=1, type=string, label=optional)
    # `status` is an enum on the wire (a varint); int32 decodes it identically.
    fdp.message_type.add(name="HealthCheckResponse").field.add(name="status", number=1, type=int32, label=optional)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


_HealthCheckRequest, _HealthCheckResponse = _health_messages()


def health_request(service: str) -> bytes:
    return bytes(_HealthCheckRequest(service=service).SerializeToString())


def health_is_serving(response: bytes) -> bool:
    return bool(_HealthCheckResponse.FromString(response).status == _SERVING)
