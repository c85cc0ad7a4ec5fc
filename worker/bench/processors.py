"""``logitpool bench processors``: each library processor's cost per engine step.

For each processor, ``update_state(None)`` + ``apply(logits)`` on seeded ``randn(B, V)`` float32
logits, with the processor enabled on every row and on a random 10% of rows (the rest of the
batch plain temperature-1 requests). Each row carries 512 prompt and 128 output ids drawn from
the vocabulary, and before each timed step (untimed) the logits buffer is restored and every
row's live output list grows by one token, as in the engine. Timing: ``--threads`` threads,
warm-up steps, the median of ``--repeats``; reported in ms and as multiples of one memory pass
(``dst.copy_(logits)`` into a preallocated tensor, timed in the same run: the sampler
benchmark's unit). A last row times every library processor loaded but enabled on no row.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.bench.sampler import _median_ms
from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.logits_processor.library import LIBRARY_PROCESSORS
from worker.logits_processor.schema import declared_keys
from worker.sampling_params import SamplingParams

# Typical settings of the library's extra_args keys (from their authors' and llama.cpp's
# defaults), by key: each processor of LIBRARY_PROCESSORS runs with the keys it declares.
TYPICAL_EXTRA_ARGS: dict[str, Any] = {
    "dry_multiplier": 0.8,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_sequence_breakers": [[13], [25], [1], [42]],
    "xtc_probability": 0.5,
    "xtc_threshold": 0.1,
    "typical_p": 0.9,
    "top_a": 0.2,
    "epsilon_cutoff": 3e-4,
    "eta_cutoff": 3e-4,
    "no_repeat_ngram_size": 3,
    "mirostat": 2,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
}


def typical_args(cls: type[LogitsProcessor]) -> dict[str, Any]:
    """``cls``'s share of TYPICAL_EXTRA_ARGS: what enables it in the benchmark."""
    keys = declared_keys(cls) or frozenset()
    return {k: v for k, v in TYPICAL_EXTRA_ARGS.items() if k in keys}


@dataclass(frozen=True)
class Result:
    name: str
    fraction: float
    ms: float
    copy_ms: float

    @property
    def passes(self) -> float:
        return self.ms / self.copy_ms


class _Step:
    """A loaded batch of processors and the untimed work between two steps."""

    def __init__(
        self, procs: list[LogitsProcessor], extra: dict[str, Any] | None, fraction: float, b: int, v: int, seed: int
    ) -> None:
        rng = random.Random(seed)
        self.rng, self.v, self.procs = rng, v, procs
        enabled = set(rng.sample(range(b), max(1, round(b * fraction)))) if extra and fraction > 0 else set()
        self.outputs = [[rng.randrange(v) for _ in range(128)] for _ in range(b)]
        added = []
        for i in range(b):
            params = SamplingParams(temperature=1.0, seed=i, extra_args=extra if i in enabled else None)
            added.append((i, params, [rng.randrange(v) for _ in range(512)], self.outputs[i]))
        update = BatchUpdate(batch_size=b, removed=[], moved=[], added=added)
        for p in procs:
            p.update_state(update)
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(b, v, generator=g)
        self.buf = torch.empty_like(self.logits)

    def before(self) -> None:
        self.buf.copy_(self.logits)
        for out in self.outputs:
            out.append(self.rng.randrange(self.v))

    def step(self) -> None:
        x = self.buf
        for p in self.procs:
            p.update_state(None)
            x = p.apply(x)


def run_case(
    classes: Sequence[type[LogitsProcessor]],
    fraction: float,
    b: int,
    v: int,
    *,
    warmup: int,
    repeats: int,
    seed: int,
    copy_ms: float,
    rounds: int = 1,
) -> Result:
    """One table row; with ``rounds`` > 1 the lowest of that many medians (shared machines)."""
    cpu = torch.device("cpu")
    procs = [c(None, cpu, False) for c in classes]
    extra = {k: val for c in classes for k, val in typical_args(c).items()} if fraction > 0 else None
    s = _Step(procs, extra, fraction, b, v, seed)
    ms = min(_median_ms(s.step, s.before, warmup, repeats) for _ in range(rounds))
    name = classes[0].__name__ if len(classes) == 1 else f"all {len(classes)} loaded, unused"
    return Result(name, fraction, ms, copy_ms)


def copy_pass_ms(b: int, v: int, warmup: int, repeats: int, rounds: int = 1) -> float:
    logits = torch.randn(b, v)
    dst = torch.empty_like(logits)
    return min(_median_ms(lambda: dst.copy_(logits), lambda: None, warmup, repeats) for _ in range(rounds))


def table(results: Sequence[Result], b: int, v: int) -> str:
    head = [f"B={b}, V={v}", "| processor | rows enabled | median ms/step | × copy_ pass |", "|---|---|---|---|"]
    rows = [f"| {r.name} | {r.fraction:.0%} | {r.ms:.2f} | {r.passes:.2f} |" for r in results]
    return "\n".join(head + rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="logitpool bench processors", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.1])
    ap.add_argument("--processors", nargs="+", choices=[c.__name__ for c in LIBRARY_PROCESSORS])
    ap.add_argument("--quick", action="store_true", help="B 64, V 32000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1, help="repeat each case, keep the lowest medians")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_size, args.vocab_size = 64, 32000
    torch.set_num_threads(args.threads)
    b, v = args.batch_size, args.vocab_size
    classes = [c for c in LIBRARY_PROCESSORS if not args.processors or c.__name__ in args.processors]
    copy_ms = copy_pass_ms(b, v, args.warmup, args.repeats, args.rounds)
    print(f"copy_ pass: {copy_ms:.2f} ms", flush=True)
    cases: list[tuple[list[type[LogitsProcessor]], float]] = [([c], f) for c in classes for f in args.fractions]
    cases.append((list(LIBRARY_PROCESSORS), 0.0))
    results = []
    for cls_list, fraction in cases:
        results.append(
            run_case(
                cls_list,
                fraction,
                b,
                v,
                warmup=args.warmup,
                repeats=args.repeats,
                seed=args.seed,
                copy_ms=copy_ms,
                rounds=args.rounds,
            )
        )
        print(table(results[-1:], b, v).splitlines()[-1], flush=True)
    print()
    print(table(results, b, v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
