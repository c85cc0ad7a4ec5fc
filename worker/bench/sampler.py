"""``logitpool bench sampler``: the Sampler on seeded inputs (docs/benchmarks.md, "The sampler").

Logits are seeded ``randn(B, V)`` float32 (the hard case for top-p; ``--peaked`` adds
``randn * 8`` rows, closer to a trained model). Mixes, per row from a seeded RNG:
  a  every row greedy
  b  every row temperature 0.8, nothing else
  c  temperature from {0, .3, .6, .9, 1.2, 1.5} (row 0 greedy, row 1 0.9), top-k {off, 50},
     top-p {1, .9}, min-p .05 on a random half, repetition 1.1 + frequency .2 + presence .2 on a
     random quarter (512 prompt + 128 output ids each), an 8-token logit bias in [-5, 5] on a
     random sixteenth; every row carries a seed; greedy rows drop top-k/top-p/min-p
  d  c plus logprobs=5 (raw) on every row
Timing: ``--threads`` threads, warm-up calls, then the median of ``--repeats``; the logits buffer
is restored (untimed) before each call because the sampler works in place. The memory pass
``dst.copy_(logits)`` into a preallocated tensor and ``logits.clone()`` are timed in the same
run; the table reports each mix as a multiple of the copy pass.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.batch import PersistentBatch
from worker.logits_processor.registry import build_logits_processors
from worker.sampler import Sampler
from worker.sampling_params import SamplingParams

MIXES = ("a", "b", "c", "d")
TEMPERATURES = (0.0, 0.3, 0.6, 0.9, 1.2, 1.5)


def mix_params(
    mix: str, batch_size: int, vocab_size: int, seed: int
) -> list[tuple[SamplingParams, list[int], list[int]]]:
    """(params, prompt ids, output ids) per row for ``mix``."""
    rng = random.Random(seed)
    if mix == "a":
        return [(SamplingParams(temperature=0.0), [], []) for _ in range(batch_size)]
    if mix == "b":
        return [(SamplingParams(temperature=0.8), [], []) for _ in range(batch_size)]
    if mix not in ("c", "d"):
        raise ValueError(f"mix: must be one of {MIXES}, got {mix!r}")
    rows = []
    for i in range(batch_size):
        t = 0.0 if i == 0 else 0.9 if i == 1 else rng.choice(TEMPERATURES)
        greedy = t == 0.0
        kw: dict = dict(temperature=t, seed=rng.randrange(2**31))
        kw["top_k"] = 0 if greedy else rng.choice([0, 50])
        kw["top_p"] = 1.0 if greedy else rng.choice([1.0, 0.9])
        kw["min_p"] = 0.05 if not greedy and rng.random() < 0.5 else 0.0
        prompt: list[int] = []
        output: list[int] = []
        if rng.random() < 0.25:
            kw.update(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2)
            prompt = [rng.randrange(vocab_size) for _ in range(512)]
            output = [rng.randrange(vocab_size) for _ in range(128)]
        if rng.random() < 1 / 16:
            kw["logit_bias"] = {rng.randrange(vocab_size): rng.uniform(-5, 5) for _ in range(8)}
        if mix == "d":
            kw["logprobs"] = 5
        rows.append((SamplingParams(**kw), prompt, output))
    return rows


def _median_ms(fn: Callable[[], object], before: Callable[[], object], warmup: int, repeats: int) -> float:
    times = []
    for i in range(warmup + repeats):
        before()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    return statistics.median(times) * 1e3


@dataclass(frozen=True)
class Result:
    batch_size: int
    vocab_size: int
    mix: str
    logits: str
    sampler_ms: float
    copy_ms: float
    clone_ms: float

    @property
    def passes(self) -> float:
        return self.sampler_ms / self.copy_ms


def run_case(
    batch_size: int,
    vocab_size: int,
    mix: str,
    *,
    scale: float = 1.0,
    warmup: int = 3,
    repeats: int = 20,
    rounds: int = 1,
    seed: int = 0,
) -> Result:
    """One table row. With ``rounds`` > 1 each timing is the lowest of that many medians (shared machines)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, vocab_size, generator=g) * scale
    buf = torch.empty_like(logits)
    dst = torch.empty_like(logits)
    rows = mix_params(mix, batch_size, vocab_size, seed)
    procs = build_logits_processors(None, torch.device("cpu"), False, entry_points=False)
    pb = PersistentBatch(batch_size)
    procs.update_state(pb.update([], [(str(i), p, prompt, out) for i, (p, prompt, out) in enumerate(rows)]))
    md = pb.sampling_metadata()
    sampler = Sampler(procs, generator=torch.Generator().manual_seed(seed))
    noop = lambda: None
    sampler_ms = copy_ms = clone_ms = float("inf")
    for _ in range(rounds):
        sampler_ms = min(sampler_ms, _median_ms(lambda: sampler(buf, md), lambda: buf.copy_(logits), warmup, repeats))
        copy_ms = min(copy_ms, _median_ms(lambda: dst.copy_(logits), noop, warmup, repeats))
        clone_ms = min(clone_ms, _median_ms(logits.clone, noop, warmup, repeats))
    label = "randn" if scale == 1.0 else f"randn*{scale:g}"
    return Result(batch_size, vocab_size, mix, label, sampler_ms, copy_ms, clone_ms)


def table(results: Sequence[Result]) -> str:
    lines = [
        "| B | V | mix | logits | median ms | copy_ ms | × copy_ pass | clone ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.batch_size} | {r.vocab_size} | {r.mix} | {r.logits} | {r.sampler_ms:.2f} | "
        f"{r.copy_ms:.2f} | {r.passes:.1f} | {r.clone_ms:.2f} |"
        for r in results
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="logitpool bench sampler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    ap.add_argument("--no-peaked", action="store_true", help="skip the randn*8 rows (largest B and V, mixes b-d)")
    ap.add_argument("--quick", action="store_true", help="B 8 and 64, V 32000, no peaked rows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="repeat each case, keep the lowest medians")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.vocab_sizes, args.no_peaked = [8, 64], [32000], True
    torch.set_num_threads(args.threads)
    cases = [(b, v, m, 1.0) for b in args.batch_sizes for v in args.vocab_sizes for m in args.mixes]
    if not args.no_peaked:
        cases += [(max(args.batch_sizes), max(args.vocab_sizes), m, 8.0) for m in args.mixes if m != "a"]
    results = []
    for b, v, m, scale in cases:
        results.append(
            run_case(b, v, m, scale=scale, warmup=args.warmup, repeats=args.repeats, rounds=args.rounds, seed=args.seed)
        )
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
