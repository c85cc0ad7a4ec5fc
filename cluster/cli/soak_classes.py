"""The soak's kinds of traffic, what each may end with, and the hostile classes of issue 17.

Every request the soak sends has a kind; `ALLOWED` says which outcomes are fine for it. The
classes added by issue 17 (one request maker and one rule each):

- amplify: completions whose response would dwarf the request (``n`` choices × many prompts ×
  ``prompt_logprobs`` copied per choice, and again with ``echo``). Fine: a 400/413/422 whose
  message names the limit (``limits.``), or a served response of at most 64 MiB.
- heavy_grammar: a JSON schema of 1.5 KB whose patterns take xgrammar many CPU
  seconds to compile (measured in the README); sent in pairs, so that together they could
  occupy a compile pool. Fine: a 400/413/422 naming the constraint field (the compile bound),
  429/503 (compiles shed), or an answer where the compile fit the bound. Innocents meanwhile
  send fresh trivial constraints, which must all succeed.
- hog: one completions request at the sequence limits (``n`` × prompts). Over a declared
  ``limits.max_sequences_per_request``: a 400/413/422 naming a limit, or 429/503. At (or
  without) such a limit: served, or 429/503; a 400 for a request within every limit is a failure.
- stall: a stream whose client reads the first event, then stops reading (small socket buffers
  on the client) for ``hold_s`` seconds, then closes. Fine: ``stalled`` (held and closed), or a
  4xx/429/503 before the stream started. What it must not do is seen in the invariants:
  innocents unaffected, batches empty at the end, RSS flat.

The rules are plain data and `classify` is a pure function of what the client saw (`Answer`),
so tests/cluster_rayfree/test_soak_classes.py checks them without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc

from client import AsyncClient, LogitpoolError

# Kinds of request, and how one ended.
INNOCENT, HOSTILE, CANCEL, FAULT = "innocent", "hostile", "cancel", "fault"
AMPLIFY, HEAVY_GRAMMAR, HOG, STALL = "amplify", "heavy_grammar", "hog", "stall"
OK, REJECTED, CANCELLED, FAULTED, UNAVAILABLE, UNEXPECTED = (
    "ok",
    "rejected",
    "cancelled",
    "faulted",
    "unavailable",
    "unexpected",
)
STALLED = "stalled"

ALLOWED: dict[str, frozenset[str]] = {
    INNOCENT: frozenset({OK}),
    HOSTILE: frozenset({OK, REJECTED}),
    CANCEL: frozenset({CANCELLED, OK}),
    FAULT: frozenset({FAULTED}),
    AMPLIFY: frozenset({OK, REJECTED}),
    HEAVY_GRAMMAR: frozenset({OK, REJECTED}),
    HOG: frozenset({OK, REJECTED}),
    STALL: frozenset({STALLED, REJECTED}),
}
NEW_CLASSES = (AMPLIFY, HEAVY_GRAMMAR, HOG, STALL)


# -- the first round's hostile requests (each a 4xx / INVALID_ARGUMENT, or valid) -----------------

# Hostile HTTP requests: (name, path, raw body or JSON object, headers, statuses that are fine).
# 200 is fine only where a valid answer exists (the value is legal); everything else is a 4xx.
_4XX = (400, 413, 415, 422)


def _nested(depth: int) -> str:
    return '{"vllm_xargs": ' + '{"a": ' * depth + "1" + "}" * depth + ', "prompt": "x", "max_tokens": 2}'


HOSTILE_HTTP: list[tuple[str, str, Any, dict[str, str], tuple[int, ...]]] = [
    ("seed_2^64", "/v1/completions", {"prompt": "x", "max_tokens": 4, "seed": 2**64}, {}, _4XX),
    ("top_k_2^63", "/v1/completions", {"prompt": "x", "max_tokens": 4, "top_k": 2**63}, {}, _4XX),
    ("surrogate_prompt", "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', {}, _4XX),
    (
        "surrogate_chat",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
        {},
        _4XX,
    ),
    (
        "surrogate_role",
        "/v1/chat/completions",
        '{"messages": [{"role": "\\ud800", "content": "hi"}], "max_tokens": 2}',
        {},
        _4XX,
    ),
    (
        "surrogate_model",
        "/v1/completions",
        '{"model": "\\ud800", "prompt": "x", "max_tokens": 2}',
        {},
        (200, 404, *_4XX),
    ),
    ("surrogate_bad_words", "/v1/completions", '{"prompt": "x", "max_tokens": 2, "bad_words": ["\\ud800"]}', {}, _4XX),
    ("nested_100000", "/v1/completions", _nested(100_000), {}, _4XX),
    ("nested_500", "/v1/completions", _nested(500), {}, _4XX),
    (
        "repetition_penalty_1e-300",
        "/v1/completions",
        {"prompt": "x y x y", "max_tokens": 4, "repetition_penalty": 1e-300},
        {},
        (200, *_4XX),
    ),
    (
        "processed_logprobs_allowed",
        "/v1/completions",
        {
            "prompt": "x",
            "max_tokens": 3,
            "allowed_token_ids": [5, 6],
            "logprobs": 3,
            "logprobs_mode": "processed_logprobs",
        },
        {},
        (200, *_4XX),
    ),
    ("logit_bias_nan", "/v1/completions", '{"prompt": "x", "max_tokens": 2, "logit_bias": {"5": NaN}}', {}, _4XX),
    ("n_2000", "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 2000}, {}, _4XX),
    ("prompts_400", "/v1/completions", {"prompt": ["x"] * 400, "max_tokens": 1}, {}, _4XX),
    (
        "extra_args_10k_keys",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 1, "extra_args": {f"k{i}": i for i in range(10_000)}},
        {},
        _4XX,
    ),
    ("body_8MB", "/v1/completions", '{"prompt": "' + "a" * (8 << 20) + '", "max_tokens": 1}', {}, _4XX),
    ("text_plain", "/v1/completions", '{"prompt": "x"}', {"content-type": "text/plain"}, _4XX),
    ("not_json", "/v1/completions", "{prompt: x", {}, _4XX),
    (
        "stream_processed_logprobs",
        "/v1/completions",
        {
            "prompt": "x",
            "max_tokens": 3,
            "allowed_token_ids": [5, 6],
            "logprobs": 3,
            "logprobs_mode": "processed_logprobs",
            "stream": True,
        },
        {},
        (200, *_4XX),
    ),
]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def nested_extra_args_request(depth: int) -> bytes:
    """GenerateRequest{prompt "x", params{max_tokens 2, extra_args {"a": {"a": ... 1}}}}, encoded by
    hand: protobuf's own encoder refuses to build a message nested this deep."""
    value = _varint(3 << 3) + _varint(1)  # JsonValue.int_value = 1
    for _ in range(depth):
        entry = _field(1, b"a") + _field(2, value)  # JsonObject.fields map entry
        value = _field(7, _field(1, entry))  # JsonValue.object_value
    params = _varint(10 << 3) + _varint(2) + _field(21, _field(1, b"a") + _field(2, value))
    return _field(1, b"x") + _field(4, params)


def grpc_hostile() -> list[tuple[str, Callable[[AsyncClient], Awaitable[Any]]]]:
    def raw(payload: bytes) -> Callable[[AsyncClient], Awaitable[Any]]:
        async def call(c: AsyncClient) -> Any:
            # bytes in, bytes out
            rpc: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = c._channel.unary_unary(
                "/logitpool.v1.LogitPool/Generate"
            )
            return await rpc(payload, timeout=60, metadata=c._metadata)

        return call

    async def huge_bias(c: AsyncClient) -> Any:
        return await c.generate("x", max_tokens=3, logit_bias={67: 1e308})

    async def nan_temperature(c: AsyncClient) -> Any:
        return await c.generate("x", max_tokens=2, temperature=math.nan)

    async def int32_top_k(c: AsyncClient) -> Any:
        return await c.generate("x", max_tokens=2, top_k=2**31 - 1, temperature=1.0)

    return [
        ("grpc_garbage", raw(b"\xff\xff\xff\xff garbage")),
        ("grpc_logit_bias_1e308", huge_bias),
        ("grpc_nested_60", raw(nested_extra_args_request(60))),
        ("grpc_nan_temperature", nan_temperature),
        ("grpc_top_k_int32_max", int32_top_k),
    ]


# -- what a client saw, and the rules ---------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """An answer reduced to what the rules read: the HTTP status (gRPC codes mapped onto it),
    the error message, and the served response's size in bytes."""

    status: int
    message: str = ""
    size: int = 0


_GRPC_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


def grpc_answer(code: grpc.StatusCode | None, details: str) -> Answer:
    """A gRPC failure as an Answer; a message naming an internal class is never a fine rejection."""
    status = _GRPC_STATUS.get(code, 500) if code is not None else 500
    return Answer(500 if "<class" in details else status, details)


def http_answer(status: int, body: bytes) -> Answer:
    """An HTTP answer; the message is the JSON error body's (a non-JSON error has none)."""
    message = ""
    if status != 200:
        try:
            message = str(json.loads(body)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = ""
    return Answer(status, message, len(body))


SHED = (429, 503)  # load shedding: fine for a hostile request, names nothing


@dataclass(frozen=True)
class Rule:
    """Which answers a hostile request may get.

    ``reject``: statuses that are a fine refusal when the message contains ``names`` (the limit
    or field the refusal is about); ``shed``: fine refusals that name nothing; ``served``:
    whether a 200 is fine, and then at most ``max_size`` bytes."""

    reject: tuple[int, ...] = (400, 413, 422)
    names: str = ""
    shed: tuple[int, ...] = ()
    served: bool = True
    max_size: int | None = None


AMPLIFY_MAX_RESPONSE_BYTES = 64 << 20
AMPLIFY_RULE = Rule(names="limits.", max_size=AMPLIFY_MAX_RESPONSE_BYTES)
HEAVY_GRAMMAR_RULE = Rule(names="structured_outputs", shed=SHED)
HOG_OVER_RULE = Rule(names="limits.", shed=SHED, served=False)
HOG_WITHIN_RULE = Rule(reject=(), shed=SHED)
STALL_RULE = Rule(shed=SHED)


def classify(rule: Rule, a: Answer) -> tuple[str, str]:
    """The outcome of one hostile request under its rule; a 503 outside the rule is UNAVAILABLE
    (excused only around the replica kill)."""
    if a.status == 200:
        if not rule.served:
            return UNEXPECTED, f"served ({a.size} bytes); it should have been refused"
        if rule.max_size is not None and a.size > rule.max_size:
            return UNEXPECTED, f"served {a.size / 2**20:.1f} MiB, over {rule.max_size / 2**20:.0f} MiB: amplified"
        return OK, f"{a.size} bytes"
    if a.status in rule.reject:
        if rule.names not in a.message:
            return UNEXPECTED, f"{a.status} not naming {rule.names!r}: {a.message[:160]}"
        return REJECTED, f"{a.status}: {a.message[:160]}"
    if a.status in rule.shed:
        return REJECTED, f"{a.status} (shed): {a.message[:160]}"
    return (UNAVAILABLE if a.status == 503 else UNEXPECTED), f"status {a.status}: {a.message[:160]}"


# -- the mix ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """A kind's part of a soak: ``fraction`` of the requests, at least ``floor``, at most ``cap``."""

    fraction: float
    floor: int = 0
    cap: int | None = None

    def count(self, requests: int) -> int:
        n = max(self.floor, round(self.fraction * requests))
        return n if self.cap is None else min(n, self.cap)


# Every new class is bounded in count (and each request in time) whatever --requests says.
DEFAULT_MIX: dict[str, Share] = {
    HOSTILE: Share(0.10),
    CANCEL: Share(0.10),
    FAULT: Share(0.01, 1),
    AMPLIFY: Share(0.01, 2, 12),
    HEAVY_GRAMMAR: Share(0.01, 2, 4),
    HOG: Share(0.0004, 2, 4),
    STALL: Share(0.015, 4, 40),
}
# The warm-up leaves out what costs seconds by design (heavy compiles, the 4,096-sequence hog,
# the held streams): what they may leave behind is nothing, which the RSS check then sees.
WARMUP_MIX = {k: s for k, s in DEFAULT_MIX.items() if k not in (HEAVY_GRAMMAR, HOG, STALL)}


def plan(requests: int, rng: random.Random, mix: dict[str, Share]) -> list[str]:
    """The kinds of ``requests`` requests in sending order; innocents fill what the mix leaves.
    Heavy grammars go in adjacent pairs (two compiles at once)."""
    kinds = [k for k, share in mix.items() for _ in range(share.count(requests))]
    if len(kinds) > requests:
        raise ValueError(f"{requests} requests are fewer than the mix's floors ({len(kinds)})")
    order = kinds + [INNOCENT] * (requests - len(kinds))
    rng.shuffle(order)
    return pair_up(order, HEAVY_GRAMMAR)


def pair_up(order: list[str], kind: str) -> list[str]:
    """``order`` with every second ``kind`` moved right after the one before it."""
    out: list[str] = []
    seen, total = 0, order.count(kind)
    for k in order:
        if k != kind:
            out.append(k)
            continue
        seen += 1
        if seen % 2:
            out.extend([kind] * min(2, total - seen + 1))
    return out


# -- request makers ---------------------------------------------------------------------------

WORDS = ["def", "class", "import", "return", "self", "value", "print", "for", "while", "None"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# (name, prompts, words per prompt, n, logprobs): all with echo, prompt_logprobs = logprobs and
# one new token. "over" is ~1.6 M logprob entries (201-token prompts; a 77 MiB response where
# nothing bounds it, measured), beyond a response bound; "small" is an ordinary request, served.
AMPLIFY_SHAPES = [("amplify_over", 8, 200, 24, 20), ("amplify_small", 2, 40, 4, 5)]


def amplify_body(rng: random.Random, ordinal: int) -> tuple[str, dict[str, Any]]:
    name, prompts, length, n, k = AMPLIFY_SHAPES[ordinal % len(AMPLIFY_SHAPES)]
    body = {
        "prompt": [words(rng, length) for _ in range(prompts)],
        "n": n,
        "max_tokens": 1,
        "echo": True,
        "logprobs": k,
        "prompt_logprobs": k,
        "temperature": 0.0,
    }
    return name, body


# One property of this pattern is 2-8 CPU-seconds of xgrammar 0.2.8 on this machine (a
# repetition bound up to 128 is unrolled; ~10 MiB compiled); the salt makes every schema new to
# the cache. Sixteen keep the whole compile far past the 10 s bound on a CPU several times
# faster: with two, one compile in a CI run finished inside it, and the ~40 MiB it then left in
# the ingress's and the worker's caches read as growth in the soak's RSS check.
HEAVY_PATTERN = "s{salt}([a-z]{{1,128}}[0-9]{{1,128}}){{1,128}}"
HEAVY_PROPERTIES = 16


def heavy_schema(salt: int) -> dict[str, Any]:
    pattern = HEAVY_PATTERN.format(salt=salt)
    names = [f"p{i}" for i in range(HEAVY_PROPERTIES)]
    return {
        "type": "object",
        "properties": {p: {"type": "string", "pattern": pattern} for p in names},
        "required": names,
    }


def trivial_constraint(rng: random.Random) -> dict[str, Any]:
    """A constraint that compiles in about a millisecond, new to the cache each time."""
    salt = rng.randrange(10**9)
    return rng.choice(
        [
            {"regex": f"(yes|no) {salt}"},
            {"choice": ["def", "class", f"w{salt}"]},
            {"json": {"type": "object", "properties": {f"k{salt}": {"type": "integer"}}, "required": [f"k{salt}"]}},
        ]
    )


@dataclass(frozen=True)
class HogShape:
    prompts: int
    n: int

    @property
    def sequences(self) -> int:
        return self.prompts * self.n


def hog_shapes(max_prompts: int, max_n: int, seq_limit: int | None) -> list[tuple[str, HogShape]]:
    """The request at the sequence limits (``max_prompts`` × ``max_n``), and the largest one
    within ``seq_limit`` (256 sequences where none is declared)."""
    within = seq_limit or 256
    n = min(max_n, within)
    return [
        ("hog_limits", HogShape(max_prompts, max_n)),
        ("hog_within", HogShape(min(max_prompts, max(1, within // n)), n)),
    ]


def hog_rule(shape: HogShape, seq_limit: int | None) -> Rule:
    return HOG_OVER_RULE if seq_limit is not None and shape.sequences > seq_limit else HOG_WITHIN_RULE


def hog_body(rng: random.Random, shape: HogShape) -> dict[str, Any]:
    return {"prompt": [words(rng, 3) for _ in range(shape.prompts)], "n": shape.n, "max_tokens": 1}


# A stream worth stopping for: 2 × 128 tokens with 20 logprobs each (~300 KB of events, beyond
# HTTP/2's initial 64 KiB window and the client's buffers; loopback's own few MiB absorb an HTTP one).
STALL_SAMPLING: dict[str, Any] = {"max_tokens": 128, "n": 2, "logprobs": 20, "ignore_eos": True}
STALL_RCVBUF = 16 << 10


async def stalled_http_stream(base: str, body: dict[str, Any], hold_s: float) -> tuple[str, str]:
    """POST a stream on a raw socket with a small receive buffer, read up to the first event,
    read nothing for ``hold_s``, close."""
    url = urlsplit(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALL_RCVBUF)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=STALL_RCVBUF)
    except BaseException:
        sock.close()
        raise
    try:
        payload = json.dumps({**body, "stream": True}).encode()
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        status, length = await _read_head(reader)
        if status != 200:
            raw = await reader.readexactly(length) if length is not None else b""
            return classify(STALL_RULE, http_answer(status, raw))
        seen = b""
        while b"data: " not in seen:  # read() in small pieces: an event may be longer than the buffer
            piece = await reader.read(4096)
            if not piece:
                return UNEXPECTED, "the stream ended without an event"
            seen = seen[-8:] + piece
        await asyncio.sleep(hold_s)
        return STALLED, f"read the first event, then nothing for {hold_s:g} s"
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 5.0)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, int | None]:
    """The status and content-length of an HTTP/1.1 response head."""
    status = int((await reader.readline()).split()[1])
    length = None
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, length


async def stalled_grpc_stream(gc: AsyncClient, prompt: str, hold_s: float) -> tuple[str, str]:
    """GenerateStream: take the first chunk, read nothing for ``hold_s`` (HTTP/2 flow control
    then holds the server's writes), cancel."""
    stream = gc.stream(prompt, **STALL_SAMPLING)
    try:
        try:
            await stream.__anext__()
        except StopAsyncIteration:
            return UNEXPECTED, "the stream ended without a chunk"
        await asyncio.sleep(hold_s)
        return STALLED, f"read the first chunk, then nothing for {hold_s:g} s"
    except LogitpoolError as exc:
        return classify(STALL_RULE, grpc_answer(exc.code, str(exc)))
    finally:
        await stream.aclose()
