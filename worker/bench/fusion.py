"""`python -m worker.bench.fusion`: a decode step's forward with fused layers against without.

The 80M peer model (``worker.bench.peer_model``) loaded twice, one runner with
``fused_layers=True`` and one without, the same B decode rows at a context of L tokens each
(KV contents do not change the work). Calls alternate between the two so that load on the
machine falls on both alike; the median per step and the ratio are reported, with the number of
kernels a step runs (``count_kernels``: each a launch on a GPU), counted by the profiler.
On CPU the fused runner fuses what the engine does there (q/k/v only: ``FUSED_MLP_DEVICES``).

``--gemms``: the GEMMs fusion merges, separate against fused, at the model's shapes (read from
its config; q/k/v 768 -> 768 + 256 + 256, gate/up 768 -> 2 x 2048), M rows each, alternating:
the measurement behind fusing gate/up only on CUDA.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from worker.bench.peer_model import peer_model_path
from worker.model.loader import load_model
from worker.model.runner import ModelRunner, ScheduledSeq

BLOCK = 16


def _rows(batch: int, context: int) -> list[ScheduledSeq]:
    per_row = -(-(context + 1) // BLOCK)
    return [ScheduledSeq(list(range(r * per_row, (r + 1) * per_row)), [11 + r], context, True) for r in range(batch)]


# Ops that only make a view or look at metadata: no kernel runs for them.
_VIEWS = (
    "as_strided view _unsafe_view reshape resolve_conj resolve_neg result_type empty empty_strided detach detach_ "
    "lift_fresh transpose t expand unsqueeze squeeze split split_with_sizes chunk slice select permute alias to "
    "_to_copy contiguous size stride narrow"
)
_NO_KERNEL = frozenset("aten::" + n for n in _VIEWS.split(" "))


def count_kernels(step: Callable[[], object]) -> int:
    """The ops ``step`` dispatches that run a kernel (on a GPU, a launch each): innermost
    compute ops, not the composites that call them nor views."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()

    def computes(e: Any) -> bool:
        return e.name.startswith("aten::") and e.name not in _NO_KERNEL

    return sum(1 for e in prof.events() if computes(e) and not any(computes(c) for c in e.cpu_children))


def alternating_medians(calls: Mapping[str, Callable[[], object]], reps: int, inner: int = 1) -> dict[str, float]:
    """Median ms per call of each of ``calls``, run in turn ``reps`` times (``inner`` calls per
    timing), so load on the machine falls on all alike; one warm-up call each first."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(inner):
                call()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def ab_table(runners: dict[str, ModelRunner], rows: list[int], context: int, reps: int) -> None:
    """Print, per batch size, the median decode step of two runners (calls alternating, so load
    falls on both alike), the second's speed-up over the first, and each one's kernels per step."""
    a, b = runners
    print(f"| rows | {a} ms | {b} ms | {b} speed-up | kernels {a} | kernels {b} |")
    print("|---|---|---|---|---|---|")
    for batch in rows:
        steps = {name: functools.partial(r.execute, _rows(batch, context)) for name, r in runners.items()}
        ms = alternating_medians(steps, reps)
        ops = [count_kernels(step) for step in steps.values()]
        cells = [f"{ms[a]:.1f}", f"{ms[b]:.1f}", f"{ms[a] / ms[b]:.2f}x", *map(str, ops)]
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)


def _separate(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.functional.linear(x, w) for w in weights]


def gemm_table(rows: list[int], reps: int) -> None:
    """Median ms of the separate and the fused GEMMs per merge, M rows, at the peer model's
    shapes (read from its config)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(peer_model_path())
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    kv = cfg.num_key_value_heads * head_dim
    parts = {
        "q/k/v": [cfg.num_attention_heads * head_dim, kv, kv],
        "gate/up": [cfg.intermediate_size, cfg.intermediate_size],
    }
    g = torch.Generator().manual_seed(0)
    weights = {k: [torch.randn(n, hidden, generator=g) for n in sizes] for k, sizes in parts.items()}
    fused = {k: torch.cat(ws) for k, ws in weights.items()}
    print(f"hidden {hidden}: q/k/v -> {' + '.join(map(str, parts['q/k/v']))}, gate/up -> 2 x {cfg.intermediate_size}")
    print("| M | merge | separate ms | fused ms | fused speed-up |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, hidden, generator=g)
            for k, ws in weights.items():
                calls: dict[str, Callable[[], object]] = {
                    "separate": functools.partial(_separate, x, ws),
                    "fused": functools.partial(torch.nn.functional.linear, x, fused[k]),
                }
                ms = alternating_medians(calls, reps, inner=max(3, 2000 // m))
                sep, fus = ms["separate"], ms["fused"]
                print(f"| {m} | {k} | {sep:.3f} | {fus:.3f} | {sep / fus:.2f}x |", flush=True)


def bench_args(prog: str, rows: list[int], argv: list[str] | None, *, gemms: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--rows", type=int, nargs="+", default=rows)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    if gemms:
        p.add_argument("--gemms", action="store_true", help="time the merged GEMMs alone (behind fused_layers on CPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args


def bench_main(
    args: argparse.Namespace, gemm_table: Callable[[list[int], int], None], field: str, labels: tuple[str, str]
) -> int:
    """The A/B benches' one body: the GEMM table alone, or whole steps with ``field`` off / on."""
    if args.gemms:
        print(f"fp32 GEMMs, {args.threads} threads; median of {args.reps} rounds")
        gemm_table(args.rows, args.reps)
        return 0
    blocks = max(args.rows) * -(-(args.context + 1) // BLOCK)

    def runner(on: bool) -> ModelRunner:
        option: dict[str, Any] = {field: on}  # a ModelRunner keyword, named by the caller
        return ModelRunner(load_model(peer_model_path(), device="cpu", dtype="float32"), num_blocks=blocks, **option)

    runners = {label: runner(on) for label, on in zip(labels, (False, True), strict=True)}
    print(f"80M model, fp32, {args.threads} threads, context {args.context}; median of {args.reps} steps")
    ab_table(runners, args.rows, args.context, args.reps)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m worker.bench.fusion", [1, 8, 32], argv, gemms=True)
    return bench_main(args, gemm_table, "fused_layers", ("eager", "fused"))


if __name__ == "__main__":
    raise SystemExit(main())
