"""``logitpool bench structured``: what structured outputs cost per step, and compile times.

Step cost: B rows (default 64), every row constrained by one of ``SCHEMAS`` (mixed, cycled),
sampled through the real Sampler with all built-in processors. Each step every row's live output
grows by the next token of a valid document for its schema (tokenized once), so the matchers
walk real states; the step is timed as ``sampler(logits)`` (logits restored untimed), next to
the same step with the same rows unconstrained, and the structured processor's own parts: fill
(sync + xgrammar mask fill for all rows) and apply (one masked_fill_ over the batch).
Compile: each schema compiled by a fresh compiler (cold) and again (cached), median of repeats.
Isolation (``--isolation``): the compile pool's processes' CPU and RSS before, during and after a
heavy compile that is killed at its bound, and a trivial compile's latency alone against while
two heavy compiles hold the pool (one runs in the heavy lane, one waits for it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.batch import PersistentBatch
from worker.logits_processor.grammar_pool import GrammarPool
from worker.logits_processor.registry import build_logits_processors
from worker.logits_processor.structured import (
    StructuredOutputsLogitsProcessor,
    apply_token_bitmask_,
)
from worker.logits_processor.structured_grammar import StructuredCompiler, bitmask_words
from worker.sampler import Sampler
from worker.sampling_params import SamplingParams
from worker.structured_outputs import StructuredOutputsParams

# (schema, a valid document) pairs: nesting, enums, arrays, required fields, patterns, anyOf.
SCHEMAS: list[tuple[dict[str, Any], Any]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
            },
            "required": ["name", "age", "tags"],
        },
        {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue", "green", "red"]},
    ),
    (
        {
            "type": "object",
            "properties": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                },
                "kind": {"enum": ["start", "stop", "pause"]},
                "ok": {"type": "boolean"},
            },
            "required": ["point", "kind", "ok"],
        },
        {"point": {"x": 1.25, "y": -20.5}, "kind": "pause", "ok": True},
    ),
    (
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
                    "value": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
                "required": ["id", "value"],
            },
        },
        [{"id": "deadbeef", "value": 12}, {"id": "0badf00d", "value": None}, {"id": "a1b2c3d4", "value": 7}],
    ),
    (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "done": {"type": "boolean"},
                "steps": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
                        "required": ["n", "text"],
                    },
                },
            },
            "required": ["title", "done", "steps"],
        },
        {"title": "make tea", "done": False, "steps": [{"n": 1, "text": "boil water"}, {"n": 2, "text": "steep"}]},
    ),
]


def _median_ms(fn: Any, before: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def step_costs(tokenizer: Any, vocab_size: int, batch_size: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Median ms per step: sampler with / without constraints, and the processor's fill and apply."""
    compiler = StructuredCompiler.from_tokenizer(tokenizer, vocab_size)
    docs = [tokenizer.encode(json.dumps(doc), add_special_tokens=False) for _, doc in SCHEMAS]
    steps = min(steps, min(len(d) for d in docs) - 1)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, vocab_size, generator=g)
    buf = torch.empty_like(logits)

    def run(constrained: bool) -> tuple[list[float], list[float], list[float]]:
        procs = build_logits_processors(None, torch.device("cpu"), False, entry_points=False)
        sampler = Sampler(procs, generator=torch.Generator().manual_seed(seed))
        pb = PersistentBatch(batch_size)
        outs: list[list[int]] = [[] for _ in range(batch_size)]
        joining = []
        for i in range(batch_size):
            so = None
            if constrained:
                so = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)][0])
                so.compiled = compiler.compile(so)
            params = SamplingParams(temperature=0.8, seed=seed + i, structured_outputs=so)
            joining.append((str(i), params, [1, 2, 3], outs[i]))
        procs.update_state(pb.update([], joining))
        md = pb.sampling_metadata()
        proc = next(p for p in procs.all if isinstance(p, StructuredOutputsLogitsProcessor))
        sample_ms, fill_ms, apply_ms = [], [], []
        for t in range(steps):
            sample_ms.append(_median_ms(lambda: sampler(buf, md), lambda: buf.copy_(logits), 1))
            if constrained:  # the processor's parts, on the state the sampler just saw
                items = list(proc.states.items())
                bitmask = proc._bitmask.host(batch_size, bitmask_words(vocab_size))
                t0 = time.perf_counter()
                proc._filler.fill([r.matcher for _, r in items], [i for i, _ in items], bitmask)
                fill_ms.append((time.perf_counter() - t0) * 1e3)
                apply = functools.partial(apply_token_bitmask_, buf, bitmask)
                apply_ms.append(_median_ms(apply, lambda: buf.copy_(logits), 1))
            for i, out in enumerate(outs):
                out.append(docs[i % len(docs)][t])
            procs.update_state(None)
        return sample_ms, fill_ms, apply_ms

    free, _, _ = run(False)
    con, fill, apply = run(True)
    med = statistics.median
    return {
        "free_ms": med(free),
        "constrained_ms": med(con),
        "fill_ms": med(fill),
        "apply_ms": med(apply),
        "steps": float(steps),
    }


def compile_costs(tokenizer: Any, vocab_size: int, repeats: int) -> list[tuple[int, float, float]]:
    """(schema index, cold ms, cached ms) per schema."""
    rows = []
    for i, (schema, _) in enumerate(SCHEMAS):
        cold, warm = [], []
        for _ in range(repeats):
            c = StructuredCompiler.from_tokenizer(tokenizer, vocab_size)
            so = StructuredOutputsParams(json=schema)
            t0 = time.perf_counter()
            c.compile(so)
            t1 = time.perf_counter()
            c.compile(so)
            t2 = time.perf_counter()
            cold.append((t1 - t0) * 1e3)
            warm.append((t2 - t1) * 1e3)
        rows.append((i, statistics.median(cold), statistics.median(warm)))
    return rows


# xgrammar 0.2.8 unrolls a count up to 20000 and compiles this 46-byte schema for minutes.
HEAVY = {"type": "string", "pattern": "^(a|b){1,19999}$"}


@dataclass(frozen=True)
class Usage:
    cores: float  # CPU seconds per second over the window, all of the processes together
    rss_mb: float
    processes: int  # of them alive at the end


def _proc_cpu_rss(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MB) of one process; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return 0.0, 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), rss / 1024


def usage(pids: frozenset[int], window_s: float = 1.0) -> Usage:
    before = {p: _proc_cpu_rss(p)[0] for p in pids}
    time.sleep(window_s)
    after = {p: _proc_cpu_rss(p) for p in pids}
    alive = [rss for _, rss in after.values() if rss > 0]
    return Usage(sum(max(0.0, cpu - before[p]) for p, (cpu, _) in after.items()) / window_s, sum(alive), len(alive))


def _trivial_ms(compiler: StructuredCompiler, tag: str, n: int) -> float:
    times = []
    for i in range(n):  # distinct, so each one is a compile, not a cache hit
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(regex=f"{tag}{i}[a-z]+"))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def compile_isolation(tokenizer: Any, vocab_size: int, timeout_s: float, n: int) -> dict[str, Any]:
    """The heavy compile's process while compiling and after its kill; trivial latency alone and
    while two heavy compiles hold the pool."""
    pool = GrammarPool()
    c = StructuredCompiler.from_tokenizer(tokenizer, vocab_size, timeout_s=timeout_s, pool=pool)
    try:
        _trivial_ms(c, "w", 3)  # the pool started, its spare too
        time.sleep(1.0)
        alone = _trivial_ms(c, "a", n)
        heavy = [threading.Thread(target=_expect_error, args=(c, i), daemon=True) for i in range(2)]
        for t in heavy:
            t.start()
        while not pool.stats().heavy_pids:
            time.sleep(0.01)
        compiling = pool.stats().heavy_pids
        during = usage(compiling)
        loaded = _trivial_ms(c, "b", n)
        for t in heavy:
            t.join()
        return {
            "alone_ms": alone,
            "loaded_ms": loaded,
            "during": during,
            "after": usage(compiling),
            "kills": pool.stats().kills,
        }
    finally:
        pool.shutdown()


def _expect_error(c: StructuredCompiler, i: int) -> None:
    schema = dict(HEAVY, pattern=HEAVY["pattern"].replace("19999", str(19999 - i)))
    try:
        c.compile(StructuredOutputsParams(json=schema))
    except ValueError:
        return
    raise AssertionError("the heavy schema compiled within its bound")


def _print_isolation(r: dict[str, Any], timeout_s: float) -> None:
    d, a = r["during"], r["after"]
    print(
        f"\ncompile isolation: heavy = {json.dumps(HEAVY)}, bound {timeout_s:g}s; {r['kills']} workers killed "
        "at a bound\n"
    )
    print("| the heavy compile's worker | cores | RSS MB | alive |\n|---|---|---|---|")
    print(f"| compiling | {d.cores:.2f} | {d.rss_mb:.0f} | {d.processes} |")
    print(f"| after its kill | {a.cores:.2f} | {a.rss_mb:.0f} | {a.processes} |")
    print(
        f"\ntrivial compile (cache miss), median: alone {r['alone_ms']:.1f} ms, while two heavy compiles hold "
        f"the pool {r['loaded_ms']:.1f} ms (ratio {r['loaded_ms'] / r['alone_ms']:.2f})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="logitpool bench structured", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="HF model/tokenizer path (default: the embedded tiny model)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="compile repeats per schema")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 on a busy 2-core box is slower)")
    ap.add_argument("--isolation", action="store_true", help="also measure the compile pool under heavy compiles")
    ap.add_argument("--heavy-timeout", type=float, default=5.0, help="the compile bound for --isolation (s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoTokenizer

    from worker.model.loader import embedded_model_path

    path = args.model or str(embedded_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    s = step_costs(tokenizer, vocab_size, args.batch_size, args.steps)
    b = args.batch_size
    print(
        f"step cost, B={b}, V={vocab_size}, every row constrained ({len(SCHEMAS)} schemas mixed), "
        f"median of {int(s['steps'])} steps, torch threads={args.threads}\n"
    )
    print("| step | ms | ms per row | x unconstrained |\n|---|---|---|---|")
    print(f"| sampler, unconstrained | {s['free_ms']:.3f} | {s['free_ms'] / b:.4f} | 1.00 |")
    print(
        f"| sampler, constrained | {s['constrained_ms']:.3f} | {s['constrained_ms'] / b:.4f} | "
        f"{s['constrained_ms'] / s['free_ms']:.2f} |"
    )
    print(
        f"| of which mask fill (xgrammar) | {s['fill_ms']:.3f} | {s['fill_ms'] / b:.4f} | "
        f"{s['fill_ms'] / s['free_ms']:.2f} |"
    )
    print(
        f"| of which mask apply (torch) | {s['apply_ms']:.3f} | {s['apply_ms'] / b:.4f} | "
        f"{s['apply_ms'] / s['free_ms']:.2f} |"
    )
    print(f"\nmask fill per row and token: {1e3 * s['fill_ms'] / b:.1f} us (xgrammar reports < 40 us)\n")
    print("| schema | compile cold ms | cached ms |\n|---|---|---|")
    for i, cold, warm in compile_costs(tokenizer, vocab_size, args.repeats):
        print(f"| {i} | {cold:.2f} | {warm:.4f} |")
    if args.isolation:
        _print_isolation(compile_isolation(tokenizer, vocab_size, args.heavy_timeout, n=25), args.heavy_timeout)
    return 0
