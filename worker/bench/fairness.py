"""`logitpool bench engine --workload fairness`: a small request's latency while one maximal
request runs, against its latency alone (issue 17, item 4).

Through AsyncEngine, as a worker replica runs it: the small request (a few tokens) runs alone
``repeats`` times; then one maximal request (``hog_prompts`` prompts x ``n``, one group, as the
front end sends a batch) fills the engine, and the small request runs ``repeats`` times again
while it does. Reported per scheduling policy: p50 latency alone, p50 and max under the hog, the
ratios, and the engine steps the small request waited for its first token (the measure that
does not depend on the box's load). ``fcfs`` is the old first-come order; ``fair`` the default.
Under fcfs only the first small request waits behind the hog (the samples after it find the
hog nearly done): its max is the one to read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.async_engine import AsyncEngine
from worker.bench.latency import pct
from worker.config import EngineConfig, SchedulingPolicy
from worker.model.loader import LoadedModel
from worker.request import Scheduling
from worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class Fairness:
    policy: SchedulingPolicy
    alone_ms: float
    hog_p50_ms: float
    hog_max_ms: float
    hog_steps_max: int  # engine steps from the small request's arrival to its first token
    samples: int  # small requests that ran while the hog did

    def row(self) -> str:
        return (
            f"| {self.policy} | {self.alone_ms:.1f} | {self.hog_p50_ms:.1f} | {self.hog_max_ms:.1f} "
            f"| {self.hog_p50_ms / self.alone_ms:.2f}x | {self.hog_max_ms / self.alone_ms:.2f}x "
            f"| {self.hog_steps_max} | {self.samples} |"
        )


HEADER = (
    "| policy | small alone p50 ms | under the hog p50 ms | max ms | ratio p50 | ratio max "
    "| steps to first token (max) | samples |\n|---|---|---|---|---|---|---|---|"
)


async def _small(engine: AsyncEngine, rid: str, prompt: list[int], tokens: int) -> tuple[float, int]:
    """Latency (ms) of one small request end to end, and engine steps until its first output."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0, s0, first = time.perf_counter(), engine.engine.num_steps, None
    async for _ in engine.generate(rid, prompt, params, delta=True, scheduling=Scheduling(group=rid)):
        if first is None:
            first = engine.engine.num_steps - s0
    return 1e3 * (time.perf_counter() - t0), first or 0


async def measure(
    loaded: LoadedModel,
    policy: SchedulingPolicy,
    *,
    rows: int,
    hog_prompts: int,
    n: int,
    hog_tokens: int,
    small_tokens: int,
    repeats: int,
    prompt_len: int = 32,
) -> Fairness:
    engine = AsyncEngine(
        EngineConfig(
            max_num_seqs=rows,
            max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens, rows),
            load_entry_points=False,
            scheduling_policy=policy,
        ),
        loaded=loaded,
    )
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(10, loaded.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(hog_prompts + 1)
    ]
    small = prompts[-1]
    await _small(engine, "warm", small, small_tokens)
    alone = [(await _small(engine, f"alone-{i}", small, small_tokens))[0] for i in range(repeats)]
    hog = SamplingParams(n=n, temperature=0.0, max_tokens=hog_tokens, ignore_eos=True)

    async def drain(i: int) -> None:
        async for _ in engine.generate(f"hog-{i}", prompts[i], hog, scheduling=Scheduling(group="hog")):
            pass

    hogs = [asyncio.create_task(drain(i)) for i in range(hog_prompts)]
    while engine.stats().num_running < rows:
        await asyncio.sleep(0.01)
    under = []
    for i in range(repeats):  # only while the hog still runs (under fcfs the first wait may outlast it)
        if all(t.done() for t in hogs):
            break
        under.append(await _small(engine, f"under-{i}", small, small_tokens))
    for t in hogs:
        t.cancel()
    await asyncio.gather(*hogs, return_exceptions=True)
    await engine.shutdown()
    ms = [u[0] for u in under]
    return Fairness(policy, pct(alone, 0.5), pct(ms, 0.5), max(ms), max(u[1] for u in under), len(under))


async def table(loaded: LoadedModel, policies: Sequence[SchedulingPolicy], **kw: int) -> str:
    """One row per policy (printed by `logitpool bench engine --workload fairness`)."""
    rows = [(await measure(loaded, policy, **kw)).row() for policy in policies]
    return "\n".join([HEADER, *rows])
