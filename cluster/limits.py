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
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt

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


def parse_json(limits: Limits, body: bytes) -> Any:
    """Size and depth first, then strict JSON (no NaN/Infinity, no lone surrogates)."""
    check_body(limits, body)
    if json_depth_exceeds(body, limits.max_json_depth):
        raise ValueError(f"body: JSON nests deeper than limits.max_json_depth ({limits.max_json_depth})")
    try:
        value = json.loads(body, parse_constant=_bad_constant, parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise ValueError("body: not valid UTF-8") from exc
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


def check_request(limits: Limits, params: SamplingParams, num_prompts: int) -> None:
    """The limits on a converted request; the same for HTTP and gRPC."""
    if num_prompts > limits.max_prompts:
        raise _over("prompt", "prompts", num_prompts, "max_prompts", limits.max_prompts)
    if params.n > limits.max_n:
        raise _over("n", "completions", params.n, "max_n", limits.max_n)
    _check_words(limits, "stop", list(params.stop or ()))
    _check_words(limits, "bad_words", list(params.bad_words or ()))
    if params.logit_bias and len(params.logit_bias) > limits.max_logit_bias:
        raise _over("logit_bias", "entries", len(params.logit_bias), "max_logit_bias", limits.max_logit_bias)
    if params.allowed_token_ids is not None and len(params.allowed_token_ids) > limits.max_allowed_token_ids:
        raise _over("allowed_token_ids", "ids", len(params.allowed_token_ids), "max_allowed_token_ids",
                    limits.max_allowed_token_ids)
    if params.extra_args:
        _check_extra_args(limits, params.extra_args)
    so = params.structured_outputs
    if so is not None:
        size = len(so.spec.encode("utf-8", "surrogatepass"))
        if size > limits.max_constraint_bytes:
            raise _over(so.field_name, "bytes", size, "max_constraint_bytes", limits.max_constraint_bytes)
