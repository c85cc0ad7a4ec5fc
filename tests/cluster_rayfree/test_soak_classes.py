"""The soak's hostile classes without a cluster: the rules each answer is judged by, the mix and
its heavy-grammar pairs, the hog shapes, the report's checks, and the non-reading HTTP client
against a real local server that streams without end."""

from __future__ import annotations

import asyncio
import collections
import json
import random

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.cli import soak_classes as sc
from cluster.cli.bench_soak import Outcome, SoakReport
from cluster.limits import Limits

MiB = 1 << 20


def _error(status: int, message: str) -> sc.Answer:
    return sc.http_answer(status, json.dumps({"error": {"message": message, "code": status}}).encode())


@pytest.mark.parametrize(
    "rule, answer, expected",
    [
        # amplify: refused naming the limit, or served small
        (
            sc.AMPLIFY_RULE,
            _error(400, "prompt_logprobs: ... exceeds limits.max_response_logprobs (1048576)"),
            sc.REJECTED,
        ),
        (sc.AMPLIFY_RULE, _error(413, "body: exceeds limits.max_body_bytes"), sc.REJECTED),
        (sc.AMPLIFY_RULE, _error(400, "n: must be >= 1"), sc.UNEXPECTED),  # a refusal that names no limit
        (sc.AMPLIFY_RULE, sc.Answer(200, size=200_000), sc.OK),
        (sc.AMPLIFY_RULE, sc.Answer(200, size=77 * MiB), sc.UNEXPECTED),  # the amplification itself
        (sc.AMPLIFY_RULE, _error(503, "no replica"), sc.UNAVAILABLE),
        (sc.AMPLIFY_RULE, _error(431, "headers"), sc.UNEXPECTED),
        # heavy grammar: the compile bound, shedding, or compiled in time
        (
            sc.HEAVY_GRAMMAR_RULE,
            _error(400, "structured_outputs.json: compiling the JSON schema took longer than 10s"),
            sc.REJECTED,
        ),
        (sc.HEAVY_GRAMMAR_RULE, _error(503, "compile pool busy"), sc.REJECTED),
        (sc.HEAVY_GRAMMAR_RULE, _error(429, ""), sc.REJECTED),
        (sc.HEAVY_GRAMMAR_RULE, sc.Answer(200, size=500), sc.OK),
        (sc.HEAVY_GRAMMAR_RULE, _error(400, "prompt: empty"), sc.UNEXPECTED),
        (sc.HEAVY_GRAMMAR_RULE, _error(500, "internal"), sc.UNEXPECTED),
        # stall: refused before the stream, or shed
        (sc.STALL_RULE, _error(400, "logprobs: must be <= 5"), sc.REJECTED),
        (sc.STALL_RULE, _error(503, ""), sc.REJECTED),
        (sc.STALL_RULE, _error(500, ""), sc.UNEXPECTED),
    ],
)
def test_classify_examples(rule, answer, expected):
    assert sc.classify(rule, answer)[0] == expected


def test_hog_rules_follow_the_declared_sequence_limit():
    over, within = sc.HogShape(64, 64), sc.HogShape(4, 64)
    assert sc.hog_rule(over, 256) is sc.HOG_OVER_RULE
    assert sc.hog_rule(within, 256) is sc.HOG_WITHIN_RULE
    assert sc.hog_rule(over, None) is sc.HOG_WITHIN_RULE  # no limit declared: serving it is right
    named = _error(400, "prompt: 4096 sequences exceed limits.max_sequences_per_request (256)")
    assert sc.classify(sc.HOG_OVER_RULE, named)[0] == sc.REJECTED
    assert sc.classify(sc.HOG_OVER_RULE, sc.Answer(200, size=10))[0] == sc.UNEXPECTED
    assert sc.classify(sc.HOG_OVER_RULE, _error(503, ""))[0] == sc.REJECTED
    assert sc.classify(sc.HOG_WITHIN_RULE, named)[0] == sc.UNEXPECTED  # refused though within every limit
    assert sc.classify(sc.HOG_WITHIN_RULE, sc.Answer(200))[0] == sc.OK


def test_hog_shapes():
    assert sc.hog_shapes(64, 64, 256) == [("hog_limits", sc.HogShape(64, 64)), ("hog_within", sc.HogShape(4, 64))]
    assert sc.hog_shapes(64, 64, None)[1][1].sequences == 256
    assert sc.hog_shapes(64, 64, 32)[1][1] == sc.HogShape(1, 32)
    assert sc.hog_shapes(2, 64, 4096)[1][1] == sc.HogShape(2, 64)  # never over max_prompts


@st.composite
def answers(draw):
    status = draw(st.sampled_from([200, 400, 408, 413, 415, 422, 429, 431, 500, 503, 504]))
    message = draw(st.sampled_from(["", "n: bad", "x exceeds limits.max_n (64)", "structured_outputs.json: slow"]))
    return sc.Answer(status, message, draw(st.integers(0, 128 * MiB)))


RULES = [sc.AMPLIFY_RULE, sc.HEAVY_GRAMMAR_RULE, sc.HOG_OVER_RULE, sc.HOG_WITHIN_RULE, sc.STALL_RULE]


@settings(max_examples=300, deadline=None)
@given(rule=st.sampled_from(RULES), a=answers())
def test_classify_against_a_plain_reference(rule, a):
    if a.status == 200:
        expected = sc.OK if rule.served and (rule.max_size is None or a.size <= rule.max_size) else sc.UNEXPECTED
    elif (a.status in rule.reject and rule.names in a.message) or a.status in rule.shed:
        expected = sc.REJECTED
    else:
        expected = sc.UNAVAILABLE if a.status == 503 else sc.UNEXPECTED
    assert sc.classify(rule, a)[0] == expected


def test_answers_from_the_wire():
    assert sc.http_answer(400, b'{"error": {"message": "n: too many"}}') == sc.Answer(400, "n: too many", 37)
    assert sc.http_answer(502, b"<html>bad gateway</html>").message == ""
    assert sc.http_answer(200, b'{"error": {"message": "x"}}').message == ""  # a served body is not an error
    assert sc.grpc_answer(grpc.StatusCode.INVALID_ARGUMENT, "n: bad") == sc.Answer(400, "n: bad")
    assert sc.grpc_answer(grpc.StatusCode.RESOURCE_EXHAUSTED, "").status == 429
    assert sc.grpc_answer(grpc.StatusCode.UNAVAILABLE, "").status == 503
    assert sc.grpc_answer(grpc.StatusCode.INTERNAL, "boom").status == 500
    # a refusal that leaks an internal class name is never a fine rejection
    assert sc.grpc_answer(grpc.StatusCode.INVALID_ARGUMENT, "<class 'KeyError'>").status == 500


@pytest.mark.parametrize("requests", [64, 240, 5000])
def test_plan_counts_are_bounded(requests):
    for mix in (sc.DEFAULT_MIX, sc.WARMUP_MIX):
        counts = collections.Counter(sc.plan(requests, random.Random(requests), mix))
        assert sum(counts.values()) == requests
        for kind, share in mix.items():
            assert counts[kind] == share.count(requests)
            assert counts[kind] >= share.floor
            assert share.cap is None or counts[kind] <= share.cap
        assert counts[sc.INNOCENT] == requests - sum(share.count(requests) for share in mix.values())
    assert not {sc.HEAVY_GRAMMAR, sc.HOG, sc.STALL} & set(sc.WARMUP_MIX)


def test_plan_refuses_fewer_requests_than_the_floors():
    with pytest.raises(ValueError, match="fewer than the mix's floors"):
        sc.plan(5, random.Random(0), sc.DEFAULT_MIX)


@settings(max_examples=200, deadline=None)
@given(order=st.lists(st.sampled_from(["a", "b", "h"]), max_size=40))
def test_pair_up_puts_every_second_one_next_to_the_first(order):
    out = sc.pair_up(order, "h")
    assert sorted(out) == sorted(order)
    assert [k for k in out if k != "h"] == [k for k in order if k != "h"]
    at = [i for i, k in enumerate(out) if k == "h"]
    assert all(at[i] + 1 == at[i + 1] for i in range(0, len(at) - 1, 2))


def test_amplify_over_is_beyond_a_response_bound():
    """At least one token per word: the echoed logprobs and the per-choice prompt logprobs
    alone are over 1 Mi entries, whatever the tokenizer; the small one is an ordinary request."""
    shapes = {name: (prompts, length, n, k) for name, prompts, length, n, k in sc.AMPLIFY_SHAPES}
    prompts, length, n, k = shapes["amplify_over"]
    assert 2 * prompts * n * length * (k + 1) > 1 << 20
    name, body = sc.amplify_body(random.Random(0), 0)
    assert name == "amplify_over" and len(body["prompt"]) == prompts and body["echo"] and body["prompt_logprobs"] == k
    assert prompts <= Limits().max_prompts and n <= Limits().max_n
    prompts, length, n, k = shapes["amplify_small"]
    assert prompts * n * length * (k + 1) < 10_000


def test_constraints_are_fresh_and_heavy_ones_differ():
    rng = random.Random(0)
    trivial = [json.dumps(sc.trivial_constraint(rng), sort_keys=True) for _ in range(50)]
    assert len(set(trivial)) == 50
    assert sc.heavy_schema(1) != sc.heavy_schema(2)
    assert len(json.dumps(sc.heavy_schema(123456789))) < 4096  # far under max_constraint_bytes


def _report(outcomes, **kw):
    return SoakReport([Outcome(*o) for o in outcomes], **kw)


def test_report_judges_the_new_classes():
    report = _report(
        [
            (sc.STALL, "http_stall", sc.STALLED, "", 0.0, 3.0),
            (sc.AMPLIFY, "amplify_over", sc.REJECTED, "", 0.0, 0.1),
            (sc.HEAVY_GRAMMAR, "http_heavy_grammar", sc.REJECTED, "", 0.0, 10.0),
            (sc.HOG, "hog_limits_4096", sc.UNEXPECTED, "served", 1.0, 15.0),
            (sc.INNOCENT, "http_completion_constrained", sc.UNEXPECTED, "took longer than 10s", 2.0, 12.0),
            (sc.INNOCENT, "grpc", sc.OK, "", 20.0, 20.5),
            (sc.INNOCENT, "grpc", sc.OK, "", 5.0, 7.0),
        ],
        rss_warm={1: 100 * MiB, 2: 100 * MiB},
        rss_end={1: 104 * MiB, 2: 120 * MiB},
        roles={1: "worker", 2: "ingress"},
    )
    bad = report.violations()
    assert len(bad) == 3, bad
    assert bad[0].startswith("hog/hog_limits_4096: unexpected")
    assert bad[1].startswith("innocent/http_completion_constrained: unexpected")
    assert bad[2] == "ingress pid 2: RSS grew +20.0% after warm-up"
    assert report.innocent_latency(sc.HOG) == (1, 2.0, 2.0)  # the one from 5 s to 7 s
    assert report.innocent_latency(None) == (1, 0.5, 0.5)
    assert report.innocent_latency(sc.AMPLIFY) is None
    table = report.render()
    assert "| stall | stalled | 1 |" in table and "ingress pid 2: RSS 100 -> 120 MiB" in table
    assert "| hog | hog_limits_4096 | unexpected | 1 |" in table


def test_report_counts_worker_deaths_beyond_the_kill():
    ok = [(sc.INNOCENT, "grpc", sc.OK, "", 0.0, 1.0)]
    assert _report(ok, kill_time=0.5, died=[7]).violations() == []  # the killed one
    two = _report(ok, kill_time=0.5, died=[7, 8]).violations()
    assert two == ["worker pids [7, 8] are gone at the end; one was killed"]
    assert _report(ok, died=[7]).violations() == ["worker pids [7] are gone at the end; none was killed"]


# -- the non-reading HTTP client against a real server ----------------------------------------


class _EndlessStream:
    """A loopback HTTP server answering every request with a chunked SSE stream without end,
    counting the bytes its writes got rid of; or with one JSON error."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.written = 0
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        if self.status != 200:
            body = b'{"error": {"message": "n: too many", "code": 400}}'
            writer.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b"data: " + json.dumps({"choices": [{"text": "x" * 4000}]}).encode() + b"\n\n"
        chunk = b"%x\r\n%s\r\n" % (len(event), event)
        try:
            while True:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 30)
                self.written += len(chunk)
        except (TimeoutError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()


async def _against(server: _EndlessStream, hold_s: float) -> tuple[tuple[str, str], int]:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        result = await sc.stalled_http_stream(f"http://127.0.0.1:{port}", {"prompt": "x"}, hold_s)
        written_at_close = server.written
        if server.status == 200:
            await asyncio.wait_for(server.closed.wait(), 30)
        return result, written_at_close
    finally:
        srv.close()
        await srv.wait_closed()


def test_stalled_stream_stops_reading_and_the_server_sees_the_close():
    server = _EndlessStream()
    (result, detail), written = asyncio.run(_against(server, hold_s=1.0))
    assert result == sc.STALLED, detail
    # The client read one piece and then nothing: the server's writes stalled within the socket
    # buffers (loopback autotunes them to a few MiB), far short of what it would have sent.
    assert written < 32 * MiB
    assert server.closed.is_set()


def test_stalled_stream_refused_before_it_starts():
    (result, detail), _ = asyncio.run(_against(_EndlessStream(status=400), hold_s=1.0))
    assert (result, detail) == (sc.REJECTED, "400: n: too many")
