"""The benchmarks' latency measurement on streams with known timing."""

from __future__ import annotations

import asyncio

from worker.bench.latency import measure, pct


def test_pct_picks_order_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert pct(xs, 0.0) == 1.0 and pct(xs, 0.5) == 3.0 and pct(xs, 1.0) == 5.0
    assert pct([], 0.5) != pct([], 0.5)  # NaN when nothing was measured


def test_measure_counts_tokens_and_spreads_chunk_gaps():
    async def stream(i, prompt):
        await asyncio.sleep(0.05)  # time to first token
        yield 1
        for _ in range(3):
            await asyncio.sleep(0.04)
            yield 2  # a coalesced message of 2 tokens: two gaps of ~20 ms each

    r = asyncio.run(measure(stream, [[1], [2], [3]]))
    assert r.tok_s > 0 and r.req_s > 0
    assert abs(r.tok_s / r.req_s - 7) < 1e-9  # 1 + 3*2 tokens per request
    assert r.ttft_p50_ms >= 45  # sleeps give lower bounds only; no upper bound on a busy machine
    assert r.itl_p50_ms >= 15
