"""Client and AsyncClient against a real in-process gRPC server (tests/client/fake_server.py)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import client
from client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    LogitpoolError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    error_class,
)
from client._retry import RetryPolicy
from tests.client.fake_server import PROCESSORS, FakeLogitPool, Running, serve

REPO = Path(__file__).resolve().parents[2]
FAST = 0.001  # backoff: retries without slowing the suite
EVENT_BOUND = 10.0  # generous bound on waiting for a server-side event; never a speed assertion


@pytest.fixture
def server() -> Iterator[Running]:
    with serve(FakeLogitPool()) as running:
        yield running


@pytest.fixture
def slow_server() -> Iterator[Running]:
    with serve(FakeLogitPool(delay=0.05)) as running:
        yield running


def _expected_tokens(prompt: str, n: int, max_tokens: int) -> list[list[int]]:
    ids = [ord(c) for c in prompt]
    return [[ids[k % len(ids)] + i for k in range(max_tokens)] for i in range(n)]


# -- dependencies -----------------------------------------------------------------------------


def test_client_imports_without_torch_ray_or_worker() -> None:
    code = (
        "import sys, client; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'worker', 'cluster')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- unary / stream / processors / health ------------------------------------------------------


def test_generate_returns_all_choices_first_at_top_level(server: Running) -> None:
    with Client(server.target) as c:
        out = c.generate("ab", n=2, max_tokens=3, request_id="r-1")
    expected = _expected_tokens("ab", 2, 3)
    assert out.request_id == "r-1"
    assert [ch.token_ids for ch in out.choices] == [tuple(t) for t in expected]
    assert [ch.index for ch in out.choices] == [0, 1]
    assert out.token_ids == out.choices[0].token_ids and out.text == out.choices[0].text
    assert out.text == "".join(f"<{t}>" for t in expected[0])
    assert out.finish_reason == "length"
    assert out.usage == client.Usage(prompt_tokens=2, completion_tokens=6, total_tokens=8)
    assert out.logprobs == ()


def test_generate_with_token_ids_and_logprobs(server: Running) -> None:
    with Client(server.target) as c:
        out = c.generate([5, 9], max_tokens=2, logprobs=2)
    assert server.servicer.requests[-1].prompt_token_ids.ids == [5, 9]
    assert out.token_ids == (5, 9)
    assert [p.token_id for p in out.logprobs] == [5, 9]
    assert out.logprobs[1].logprob == -0.5 and out.logprobs[1].rank == 1 and out.logprobs[1].token == "<9>"
    assert out.logprobs[0].top == (client.Logprob(5, -0.0, 1, "<5>"), client.Logprob(6, -1.0, 2, "<6>"))
    assert out.cumulative_logprob == -0.5


def test_every_sampling_keyword_reaches_the_server(server: Running) -> None:
    sampling: dict[str, Any] = dict(
        n=1,
        temperature=0.5,
        top_p=0.75,
        top_k=-1,
        min_p=0.25,
        presence_penalty=-1.5,
        frequency_penalty=1.25,
        repetition_penalty=1.125,
        seed=2**40,
        max_tokens=2,
        min_tokens=1,
        stop=["x", "yz"],
        stop_token_ids=[3, 4],
        ignore_eos=True,
        bad_words=["bad"],
        allowed_token_ids=[7, 8],
        logit_bias={7: -100.0, 8: 2.5},
        logprobs=0,
        logprobs_mode="processed_logits",
        skip_special_tokens=False,
        extra_args={"k": 1},
        structured_outputs={"choice": ["p", "q"]},
        prompt_logprobs=3,
    )
    assert set(sampling) == client.convert.SAMPLING_FIELDS  # the test covers every field
    with Client(server.target) as c:
        c.generate("a", **sampling)
    p = server.servicer.requests[-1].params
    for name, value in sampling.items():
        if name == "allowed_token_ids":
            assert list(p.allowed_token_ids.ids) == value
        elif name in ("logit_bias",):
            assert dict(p.logit_bias) == value
        elif name == "extra_args":
            assert server.servicer.extra_args[-1] == value
        elif name == "structured_outputs":
            assert list(p.structured_outputs.choice.choices) == value["choice"]
        elif isinstance(value, list):
            assert list(getattr(p, name)) == value, name
        else:
            assert getattr(p, name) == value, name


def test_unset_keywords_stay_unset_for_engine_defaults(server: Running) -> None:
    with Client(server.target) as c:
        c.generate("a", temperature=None, max_tokens=1)
    p = server.servicer.requests[-1].params
    assert p.HasField("max_tokens") and not p.HasField("temperature") and not p.HasField("allowed_token_ids")
    assert not p.HasField("top_k") and not p.HasField("seed")


def test_empty_allowed_token_ids_is_sent_not_dropped(server: Running) -> None:
    """The server must see (and reject) an empty whitelist rather than treat it as 'no whitelist'."""
    with Client(server.target) as c:
        c.generate("a", allowed_token_ids=[], max_tokens=1)
    p = server.servicer.requests[-1].params
    assert p.HasField("allowed_token_ids") and list(p.allowed_token_ids.ids) == []


def test_extra_args_ints_arrive_as_ints(server: Running) -> None:
    extra = {
        "target_token": 67,
        "weight": 0.5,
        "whole": 2.0,
        "flag": True,
        "none": None,
        "nested": {"ids": [1, 2, 3], "mixed": [1, 1.0, "1", False]},
    }
    with Client(server.target) as c:
        c.generate("a", max_tokens=1, extra_args=extra)
    got = server.servicer.extra_args[-1]
    assert got == extra
    assert type(got["target_token"]) is int and type(got["whole"]) is float and type(got["flag"]) is bool
    assert [type(x) for x in got["nested"]["mixed"]] == [int, float, str, bool]
    assert server.servicer.requests[-1].params.extra_args["target_token"].WhichOneof("kind") == "int_value"


def test_unknown_keyword_raises_type_error_locally(server: Running) -> None:
    with Client(server.target) as c:
        with pytest.raises(TypeError, match="temprature"):
            c.generate("a", temprature=0.5)
        with pytest.raises(TypeError, match="temprature"):
            c.stream("a", temprature=0.5)
        with pytest.raises(TypeError, match="temperature"):
            c.generate("a", temperature="hot")
        with pytest.raises(TypeError, match="prompt"):
            c.generate(b"raw bytes")
    assert sum(server.servicer.calls.values()) == 0


def test_stream_concatenates_to_the_unary_result(server: Running) -> None:
    with Client(server.target) as c:
        chunks = list(c.stream("abc", n=2, max_tokens=5))
        whole = c.generate("abc", n=2, max_tokens=5)
    for i in (0, 1):
        mine = [ch for ch in chunks if ch.index == i]
        assert "".join(ch.text for ch in mine) == whole.choices[i].text
        assert tuple(t for ch in mine for t in ch.token_ids) == whole.choices[i].token_ids
        assert [ch.finish_reason for ch in mine] == [None] * 4 + ["length"]
    assert [ch.usage for ch in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].usage == whole.usage


def test_processors(server: Running) -> None:
    with Client(server.target) as c:
        infos = c.processors()
    assert [i.name for i in infos] == [p.name for p in PROCESSORS]
    assert infos[0].extra_args_schema is None and infos[0].argmax_invariant
    assert infos[1] == client.ProcessorInfo(
        name="force_token",
        fqcn="tests.fixtures:ForceToken",
        argmax_invariant=False,
        extra_args_keys=("target_token",),
        extra_args_schema={"type": "object", "properties": {"target_token": {"type": "integer"}}},
    )


def test_health(server: Running) -> None:
    with Client(server.target) as c:
        assert c.health() is True
        server.set_serving(False)
        assert c.health() is False
        assert c.health("no.such.Service") is False


def test_health_of_an_unreachable_server_is_false() -> None:
    with serve() as running:
        target = running.target
    with Client(target, timeout=5.0) as c:
        assert c.health() is False


# -- metadata ---------------------------------------------------------------------------------


def test_api_key_and_application_travel_as_metadata(server: Running) -> None:
    with Client(server.target, api_key="sk-1", application="logitpool") as c:
        c.generate("a", max_tokens=1)
        list(c.stream("a", max_tokens=1))
        c.processors()
    for md in server.servicer.metadata:
        assert md["authorization"] == "Bearer sk-1"
        assert md["application"] == "logitpool"
    with Client(server.target) as c:
        c.processors()
    assert "authorization" not in server.servicer.metadata[-1] and "application" not in server.servicer.metadata[-1]


# -- errors -----------------------------------------------------------------------------------

STATUS_CASES = [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
    (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
    (grpc.StatusCode.INTERNAL, InternalError),
    (grpc.StatusCode.NOT_FOUND, LogitpoolError),
]


@pytest.mark.parametrize(("code", "cls"), STATUS_CASES)
def test_status_maps_to_exception_with_server_message(
    server: Running, code: grpc.StatusCode, cls: type[LogitpoolError]
) -> None:
    server.servicer.fail(code, f"temperature: must be in [0, 2] ({code.name})", times=2)
    with Client(server.target, max_retries=0) as c:
        with pytest.raises(cls) as unary:
            c.generate("a")
        with pytest.raises(cls) as streamed:
            list(c.stream("a"))
    for err in (unary.value, streamed.value):
        assert type(err) is cls and err.code == code
        assert str(err) == err.message == f"temperature: must be in [0, 2] ({code.name})"


def test_error_class_falls_back_to_the_base() -> None:
    assert error_class(grpc.StatusCode.UNIMPLEMENTED) is LogitpoolError
    assert issubclass(InvalidArgument, ValueError) and issubclass(DeadlineExceeded, TimeoutError)


# -- retries ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_unary_retries_transient_errors(server: Running, code: grpc.StatusCode) -> None:
    server.servicer.fail(code, times=2)
    with Client(server.target, max_retries=3, backoff=FAST) as c:
        out = c.generate("a", max_tokens=1)
        assert out.token_ids == (ord("a"),)
    assert server.servicer.calls["Generate"] == 3


def test_unary_gives_up_after_max_retries(server: Running) -> None:
    server.servicer.fail(grpc.StatusCode.UNAVAILABLE, "replica died", times=10)
    with Client(server.target, max_retries=2, backoff=FAST) as c, pytest.raises(Unavailable, match="replica died"):
        c.processors()
    assert server.servicer.calls["ListProcessors"] == 3


def test_invalid_argument_is_never_retried(server: Running) -> None:
    server.servicer.fail(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]", times=5)
    with Client(server.target, max_retries=3, backoff=FAST) as c:
        with pytest.raises(InvalidArgument, match=r"top_p: must be in \(0, 1\]"):
            c.generate("a")
        with pytest.raises(InvalidArgument):
            list(c.stream("a"))
    assert server.servicer.calls["Generate"] == 1 and server.servicer.calls["GenerateStream"] == 1


def test_stream_retries_before_the_first_chunk(server: Running) -> None:
    server.servicer.fail(grpc.StatusCode.UNAVAILABLE, times=2)
    with Client(server.target, max_retries=3, backoff=FAST) as c:
        chunks = list(c.stream("ab", max_tokens=3))
    assert [ch.token_ids for ch in chunks] == [(97,), (98,), (97,)]
    assert server.servicer.calls["GenerateStream"] == 3


def test_stream_never_retries_after_a_chunk(server: Running) -> None:
    server.servicer.fail(grpc.StatusCode.UNAVAILABLE, "replica died", times=3, after_messages=1)
    seen = []
    with Client(server.target, max_retries=3, backoff=FAST) as c, pytest.raises(Unavailable, match="replica died"):
        for chunk in c.stream("ab", max_tokens=3):
            seen.append(chunk)  # noqa: PERF402 - keeps the chunks that came before the stream raised
    assert [ch.token_ids for ch in seen] == [(97,)]
    assert server.servicer.calls["GenerateStream"] == 1


def test_retry_policy_waits_double_and_never_past_the_deadline() -> None:
    policy = RetryPolicy(max_retries=3, backoff=0.1)
    err = Unavailable("x")
    assert [policy.wait_before_retry(k, err, remaining=10.0) for k in range(4)] == [0.1, 0.2, 0.4, None]
    assert policy.wait_before_retry(2, err, remaining=0.3) is None
    assert policy.wait_before_retry(0, ResourceExhausted("x"), remaining=10.0) == 0.1
    for other in (InvalidArgument("x"), InternalError("x"), DeadlineExceeded("x"), Unauthenticated("x")):
        assert policy.wait_before_retry(0, other, remaining=10.0) is None
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="timeout"):
        Client("127.0.0.1:1", timeout=float("inf"))


# -- deadlines and cancellation ---------------------------------------------------------------


def test_timeout_bounds_a_stream(slow_server: Running) -> None:
    with Client(slow_server.target, timeout=1.0) as c:
        c.processors()  # connect first, so the deadline is spent on the stream itself
        stream = c.stream("a", max_tokens=10_000)
        next(stream)
        with pytest.raises(DeadlineExceeded):
            list(stream)
    assert slow_server.servicer.cancelled.wait(EVENT_BOUND)


def test_timeout_bounds_a_unary_call(server: Running) -> None:
    server.servicer.delay = 60.0
    with Client(server.target) as c:
        c.processors()
        with pytest.raises(DeadlineExceeded):
            c.generate("a", timeout=0.5)
    assert server.servicer.cancelled.wait(EVENT_BOUND)


def test_close_cancels_the_stream_on_the_server(slow_server: Running) -> None:
    with Client(slow_server.target) as c:
        stream = c.stream("a", max_tokens=10_000)
        first = next(stream)
        stream.close()
        assert first.token_ids == (97,)
        assert list(stream) == []
        assert slow_server.servicer.cancelled.wait(EVENT_BOUND)


def test_leaving_a_with_block_cancels_the_stream(slow_server: Running) -> None:
    with Client(slow_server.target) as c:
        with c.stream("a", max_tokens=10_000) as stream:
            for _ in stream:
                break
        assert slow_server.servicer.cancelled.wait(EVENT_BOUND)


# -- async client -----------------------------------------------------------------------------


def test_async_generate_stream_processors_health(server: Running) -> None:
    async def main() -> None:
        async with AsyncClient(server.target, api_key="k", application="app") as c:
            out = await c.generate("ab", n=2, max_tokens=3, extra_args={"target_token": 67})
            chunks = [ch async for ch in c.stream("ab", n=2, max_tokens=3)]
            infos = await c.processors()
            healthy = await c.health()
        assert [ch.token_ids for ch in out.choices] == [tuple(t) for t in _expected_tokens("ab", 2, 3)]
        assert "".join(ch.text for ch in chunks if ch.index == 1) == out.choices[1].text
        assert chunks[-1].usage == out.usage
        assert [i.name for i in infos] == ["min_p", "force_token"]
        assert healthy is True

    asyncio.run(main())
    assert type(server.servicer.extra_args[0]["target_token"]) is int
    assert all(md["authorization"] == "Bearer k" and md["application"] == "app" for md in server.servicer.metadata)


def test_async_errors_and_retries(server: Running) -> None:
    async def main() -> None:
        async with AsyncClient(server.target, max_retries=3, backoff=FAST) as c:
            server.servicer.fail(grpc.StatusCode.UNAVAILABLE, times=2)
            await c.generate("a", max_tokens=1)
            server.servicer.fail(grpc.StatusCode.RESOURCE_EXHAUSTED, times=2)
            assert len([ch async for ch in c.stream("a", max_tokens=2)]) == 2
            server.servicer.fail(grpc.StatusCode.INVALID_ARGUMENT, "min_p: must be in [0, 1]")
            with pytest.raises(InvalidArgument, match=r"min_p: must be in \[0, 1\]"):
                await c.generate("a")
            server.servicer.fail(grpc.StatusCode.UNAVAILABLE, "replica died", times=3, after_messages=1)
            seen = []
            with pytest.raises(Unavailable, match="replica died"):
                async for ch in c.stream("a", max_tokens=3):
                    seen.append(ch)  # noqa: PERF401 - keeps the chunks that came before the stream raised
            assert len(seen) == 1
            with pytest.raises(TypeError):
                c.stream("a", bogus=1)

    asyncio.run(main())
    assert server.servicer.calls["Generate"] == 3 + 1
    assert server.servicer.calls["GenerateStream"] == 3 + 1


def test_async_aclose_cancels_the_stream(slow_server: Running) -> None:
    async def main() -> None:
        async with AsyncClient(slow_server.target) as c:
            async with c.stream("a", max_tokens=10_000) as stream:
                async for _ in stream:
                    break
            assert [ch async for ch in stream] == []

    asyncio.run(main())
    assert slow_server.servicer.cancelled.wait(EVENT_BOUND)


def test_dropping_an_async_stream_cancels_it(slow_server: Running) -> None:
    async def main() -> None:
        async with AsyncClient(slow_server.target) as c:
            stream = c.stream("a", max_tokens=10_000)
            await stream.__anext__()
            del stream
            gc.collect()
            # the channel stays open: only the dropped stream's call may end
            for _ in range(int(EVENT_BOUND / 0.01)):
                if slow_server.servicer.cancelled.is_set():
                    break
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert slow_server.servicer.cancelled.is_set()


def test_async_timeout(slow_server: Running) -> None:
    async def main() -> None:
        async with AsyncClient(slow_server.target, timeout=1.0) as c:
            await c.processors()
            stream = c.stream("a", max_tokens=10_000)
            await stream.__anext__()
            with pytest.raises(DeadlineExceeded):
                async for _ in stream:
                    pass

    asyncio.run(main())
    assert slow_server.servicer.cancelled.wait(EVENT_BOUND)
