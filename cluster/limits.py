"""Request size limits, enforced at the ingress before anything expensive runs.

The defaults are stated once, here, in `Limits` (the `limits` section of `LogitpoolConfig`).
HTTP and gRPC apply the same checks: the body checks (`check_body`, `parse_json`) run on raw
HTTP bytes, `check_request` on the converted request of either protocol. Every failure names
the limit (`limits.<name>`) and the field it concerns.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator

from worker.structured_outputs import MAX_CONSTRAINT_BYTES

if TYPE_CHECKING:
    from worker.sampling_params import SamplingParams


class RequestRejected(ValueError):
    """A bad request whose HTTP status is not the generic 400 (cluster.errors.classify reads it)."""

    http_status = 400


class PayloadTooLarge(RequestRejected):
    http_status = 413


class UnsupportedMediaType(RequestRejected):
    http_status = 415


class RequestTimeout(RequestRejected):
    http_status = 408


class Limits(BaseModel):
    """Per-request bounds; a request beyond any of them is rejected (400/413, INVALID_ARGUMENT)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: PositiveInt = 1 << 20
    """A request body (HTTP) or serialized request message (gRPC): 1 MiB."""
    max_json_depth: PositiveInt = 32
    """Nesting of objects/arrays in a JSON body, checked before it is parsed."""
    max_extra_args_bytes: PositiveInt = 64 << 10
    """`extra_args` / `vllm_xargs` serialized as JSON."""
    max_extra_args_depth: PositiveInt = 8
    max_extra_args_keys: PositiveInt = 256
    """Object keys in `extra_args`, counted at every level."""
    max_n: PositiveInt = 64
    max_prompts: PositiveInt = 64
    """Prompts in one completions request (a batch)."""
    max_sequences_per_request: PositiveInt = 256
    """Sequences one request asks the engine for: prompts x `n`. Each takes a batch row while it
    runs; the engine's admission is fair between requests, and this bounds how much one may queue.
    `max_n` and `max_prompts` may not exceed it (a limit that could never be reached)."""
    max_stop: PositiveInt = 32
    """Stop strings in `stop`, and likewise words in `bad_words`."""
    max_stop_chars: PositiveInt = 512
    """Characters in one stop string or bad word."""
    max_logit_bias: PositiveInt = 1024
    max_allowed_token_ids: PositiveInt = 1 << 17
    max_constraint_bytes: PositiveInt = MAX_CONSTRAINT_BYTES
    """A structured-output constraint (schema, regex, grammar or choices) in UTF-8 bytes, checked
    before it is compiled. The engine enforces its own bound (the default) as well: raising this
    past it lets nothing larger through."""
    read_timeout_s: PositiveFloat = 10.0
    """HTTP: the whole request (headers and body) must arrive within this many seconds of the
    connection, or of the first byte of a later request on it (see cluster.slow_clients)."""
    write_stall_timeout_s: PositiveFloat = 30.0
    """HTTP: a client that stops reading a response (the socket's buffers full) for this long is
    disconnected, and its request aborted (see cluster.slow_clients)."""
    max_header_bytes: PositiveInt = 64 << 10
    """HTTP: a request's head (request line and headers); past it Serve's proxy answers 431 and
    closes the connection (see cluster.slow_clients)."""
    max_response_logprobs: PositiveInt = 1 << 20
    """Logprob entries one response may carry (`response_logprobs`), estimated before admission:
    prompt logprobs, once per choice where the protocol copies them, echoed and generated ones."""
    max_grpc_message_bytes: PositiveInt = 4 << 20
    """gRPC: the largest message Serve's proxy receives or sends, raised to max_body_bytes if
    below it (`grpc_message_bytes`). Serve has one setting for both, process-wide:
    RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, set from this by `logitpool serve` and the chart. A larger
    request is RESOURCE_EXHAUSTED before anything reads it; a unary response larger than this is
    RESOURCE_EXHAUSTED naming it (GenerateStream sends one message per delta)."""

    @property
    def grpc_message_bytes(self) -> int:
        """The gRPC message bound in effect: a request within max_body_bytes always fits."""
        return max(self.max_grpc_message_bytes, self.max_body_bytes)

    @model_validator(mode="after")
    def _sequences_cover_n_and_prompts(self) -> Limits:
        for name in ("max_n", "max_prompts"):
            if getattr(self, name) > self.max_sequences_per_request:
                raise ValueError(
                    f"limits.{name} ({getattr(self, name)}) must be <= limits.max_sequences_per_request "
                    f"({self.max_sequences_per_request})"
                )
        return self


def check_body(limits: Limits, body: bytes) -> None:
    if len(body) > limits.max_body_bytes:
        raise PayloadTooLarge(f"body: {len(body)} bytes exceeds limits.max_body_bytes ({limits.max_body_bytes})")


# A JSON string (escapes included) or one bracket; everything else is skipped in C.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth_exceeds(body: bytes, max_depth: int) -> bool:
    """Whether brackets outside strings nest deeper than max_depth; linear, no recursion."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    depth = 0
    for m in _TOKENS.finditer(body):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def _bad_constant(name: str) -> Any:
    raise ValueError(f"body: {name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"body: number {text[:32]} is out of range")
    return value


def utf8_text(body: bytes) -> str:
    """The body as UTF-8 text, the only encoding of JSON on the wire (RFC 8259 §8.1).

    ``json.loads(bytes)`` would also take UTF-16 and UTF-32 (detected from NUL bytes, RFC 4627
    §3), which the byte-level checks here (the surrogate scan, the depth scan) cannot see into:
    those are 415. A UTF-8 byte order mark is skipped, as RFC 8259 allows; bytes that are not
    UTF-8 are 400.
    """
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise UnsupportedMediaType(f"body: JSON must be UTF-8 (RFC 8259), this body looks like {encoding}")
    try:
        return body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"body: not valid UTF-8 (at byte {exc.start})") from exc


def parse_json(limits: Limits, body: bytes) -> Any:
    """Size and depth first, then strict UTF-8 JSON (no NaN/Infinity, no lone surrogates)."""
    check_body(limits, body)
    if json_depth_exceeds(body, limits.max_json_depth):
        raise ValueError(f"body: JSON nests deeper than limits.max_json_depth ({limits.max_json_depth})")
    text = utf8_text(body)
    try:
        value = json.loads(text, parse_constant=_bad_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ValueError(f"body: invalid JSON ({exc.msg})") from exc
    if _SURROGATE_ESCAPE.search(body):
        _reject_surrogates(value)
    return value


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _reject_surrogates(value: Any) -> None:
    """A lone surrogate (``"\\ud800"``) anywhere is invalid Unicode: name the field holding it."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                raise ValueError(f"{path or 'body'}: contains a lone surrogate (invalid Unicode)")
        elif isinstance(v, dict):
            for k, item in v.items():
                if _has_surrogate(k):
                    raise ValueError(f"{path or 'body'}: a key contains a lone surrogate (invalid Unicode)")
                stack.append((f"{path}.{k}" if path else k, item))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(v))


def _over(field: str, what: str, value: int, limit_name: str, limit: int) -> ValueError:
    return ValueError(f"{field}: {value} {what} exceeds limits.{limit_name} ({limit})")


def _check_extra_args(limits: Limits, extra: dict[str, Any]) -> None:
    keys = 0
    stack: list[tuple[Any, int]] = [(extra, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limits.max_extra_args_depth:
            raise ValueError(
                f"extra_args: nests deeper than limits.max_extra_args_depth ({limits.max_extra_args_depth})"
            )
        if isinstance(v, dict):
            keys += len(v)
            if keys > limits.max_extra_args_keys:
                raise _over("extra_args", "keys", keys, "max_extra_args_keys", limits.max_extra_args_keys)
            stack.extend((item, depth + 1) for item in v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend((item, depth + 1) for item in v)
    size = len(json.dumps(extra, default=str).encode("utf-8", "surrogatepass"))
    if size > limits.max_extra_args_bytes:
        raise _over("extra_args", "bytes", size, "max_extra_args_bytes", limits.max_extra_args_bytes)


def _check_words(limits: Limits, field: str, words: list[str]) -> None:
    if len(words) > limits.max_stop:
        raise _over(field, "entries", len(words), "max_stop", limits.max_stop)
    for w in words:
        if len(w) > limits.max_stop_chars:
            raise _over(field, "characters", len(w), "max_stop_chars", limits.max_stop_chars)


def check_sequences(limits: Limits, n: int, num_prompts: int) -> None:
    """prompts x n sequences within limits.max_sequences_per_request."""
    if n * num_prompts > limits.max_sequences_per_request:
        raise ValueError(
            f"n: {num_prompts} prompts x n {n} = {n * num_prompts} sequences exceeds "
            f"limits.max_sequences_per_request ({limits.max_sequences_per_request})"
        )


def check_request(limits: Limits, params: SamplingParams, num_prompts: int) -> None:
    """The limits on a converted request; the same for HTTP and gRPC."""
    if num_prompts > limits.max_prompts:
        raise _over("prompt", "prompts", num_prompts, "max_prompts", limits.max_prompts)
    if params.n > limits.max_n:
        raise _over("n", "completions", params.n, "max_n", limits.max_n)
    check_sequences(limits, params.n, num_prompts)
    _check_words(limits, "stop", list(params.stop or ()))
    _check_words(limits, "bad_words", list(params.bad_words or ()))
    if params.logit_bias and len(params.logit_bias) > limits.max_logit_bias:
        raise _over("logit_bias", "entries", len(params.logit_bias), "max_logit_bias", limits.max_logit_bias)
    if params.allowed_token_ids is not None and len(params.allowed_token_ids) > limits.max_allowed_token_ids:
        raise _over(
            "allowed_token_ids",
            "ids",
            len(params.allowed_token_ids),
            "max_allowed_token_ids",
            limits.max_allowed_token_ids,
        )
    if params.extra_args:
        _check_extra_args(limits, params.extra_args)
    so = params.structured_outputs
    if so is not None:
        size = len(so.spec.encode("utf-8", "surrogatepass"))
        if size > limits.max_constraint_bytes:
            raise _over(so.field_name, "bytes", size, "max_constraint_bytes", limits.max_constraint_bytes)


@dataclass(frozen=True)
class ResponseShape:
    """Where a protocol's response puts logprobs, for `response_logprobs`.

    ``prompt_logprobs_per_choice``: OpenAI completions (not streamed) copy a prompt's logprobs
    into each of its ``n`` choices; chat and gRPC send them once. ``echo``: each choice's
    logprobs also start with the prompt's (when logprobs are asked for).
    """

    prompt_logprobs_per_choice: bool = False
    echo: bool = False


ONCE = ResponseShape()
"""Chat's and gRPC's shape: prompt logprobs once per response, no echo."""


def response_logprobs(
    params: SamplingParams, prompt_lens: Sequence[int], max_model_len: int, shape: ResponseShape = ONCE
) -> int:
    """Upper bound on the logprob entries (a token and each of its top-k, one entry each) in a
    response: per prompt of L tokens, with k = logprobs, kp = prompt_logprobs and at most M
    generated tokens, ``n × M × (k + 1)`` plus ``copies × L × (kp + 1)``, where copies is 1, or
    n when each choice repeats the prompt's, plus n more when each choice echoes them."""
    n, k, kp = params.n, params.logprobs, params.prompt_logprobs
    total = 0
    for length in prompt_lens:
        if k is not None:
            total += n * max(1, min(params.max_tokens, max_model_len - length)) * (k + 1)
        if kp is not None:
            copies = (n if shape.prompt_logprobs_per_choice else 1) + (n if shape.echo and k is not None else 0)
            total += copies * length * (kp + 1)
    return total


def check_response(
    limits: Limits, params: SamplingParams, prompt_lens: Sequence[int], max_model_len: int, shape: ResponseShape = ONCE
) -> None:
    """The response a request asks for, bounded before admission (`limits.max_response_logprobs`)."""
    entries = response_logprobs(params, prompt_lens, max_model_len, shape)
    if entries > limits.max_response_logprobs:
        field = "prompt_logprobs" if params.prompt_logprobs is not None else "logprobs"
        raise ValueError(
            f"{field}: the response would carry up to {entries} logprob entries (prompts x n x tokens x "
            f"(logprobs + 1)), which exceeds limits.max_response_logprobs ({limits.max_response_logprobs}); "
            "ask for fewer prompts, choices, tokens or logprobs"
        )
