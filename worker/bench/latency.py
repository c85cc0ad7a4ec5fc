"""Throughput and latency of concurrent token streams: the one measurement both the engine and
the serving benchmarks use (TTFT, inter-token latency, requests/s, output tokens/s)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the serving benchmark measures through this module without an engine
    from worker.async_engine import AsyncEngine

# A stream: (index, prompt token ids) -> the number of new tokens in each message received.
Stream = Callable[[int, list[int]], AsyncIterator[int]]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@dataclass(frozen=True)
class Latency:
    req_s: float
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


async def measure(stream: Stream, prompts: list[list[int]]) -> Latency:
    """Run every prompt at once; a message of k tokens counts k inter-token gaps of gap/k."""
    ttft: list[float] = []
    itl: list[float] = []

    async def one(i: int) -> int:
        t0 = time.perf_counter()
        last, n = None, 0
        async for k in stream(i, prompts[i]):
            now = time.perf_counter()
            if k == 0:
                continue
            if last is None:
                ttft.append(now - t0)
            else:
                itl.extend([(now - last) / k] * k)
            last, n = now, n + k
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    return Latency(
        len(prompts) / wall,
        sum(counts) / wall,
        1e3 * pct(ttft, 0.5),
        1e3 * pct(ttft, 0.99),
        1e3 * pct(itl, 0.5),
        1e3 * pct(itl, 0.99),
    )


def engine_stream(engine: AsyncEngine, new_tokens: int) -> Stream:
    """Greedy, EOS-ignored requests through an in-process AsyncEngine."""
    from worker.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    async def run(i: int, prompt: list[int]) -> AsyncIterator[int]:
        async for out in engine.generate(uuid.uuid4().hex, prompt, params, delta=True):
            yield sum(len(c.token_ids) for c in out.outputs)

    return run
