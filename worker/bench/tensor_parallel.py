"""Per-step time at TP = 1 and TP = 2 on the 80M model, with the collectives broken out.

``logitpool bench tp [--seqs 8] [--prompt-len 64] [--tokens 32]``: the same decode-heavy workload
through an engine at each size; per decode step the wall time, and (TP = 2) rank 0's time and
bytes in the step broadcast, the all-reduces (embedding + 2 per layer) and the logits gather.
On CPU the ranks share the host's cores: each rank gets cores / TP threads, so TP = 2 is no
faster here; the point is what the communication costs per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.bench.peer_model import peer_model_path
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.executor.tensor_parallel import TensorParallelRunner
from worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepCost:
    tp: int
    steps: int
    step_ms: float  # median wall time of a decode step
    comm_ms: dict[str, float]  # per decode step, rank 0's time in each collective
    comm_bytes: dict[str, int]  # per decode step, bytes rank 0 puts into each collective
    tokens: list[list[int]]


def _run(tp: int, args: argparse.Namespace) -> StepCost:
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // tp))
    config = EngineConfig(
        model=str(peer_model_path()),
        dtype="float32",
        device="cpu",
        max_num_seqs=args.seqs,
        max_model_len=args.prompt_len + args.tokens + 8,
        load_entry_points=False,
        tensor_parallel_size=tp,
    )
    engine = LLMEngine(config)
    try:
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        for i in range(args.seqs):
            engine.add_request(f"r{i}", torch.randint(10, 2900, (args.prompt_len,), generator=g).tolist(), params)
        runner = engine.runner
        stats = runner.group.stats if isinstance(runner, TensorParallelRunner) else None
        times: list[float] = []
        seconds0: dict[str, float] = {}
        bytes0: dict[str, int] = {}
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            decode = engine.num_running == args.seqs and engine.num_waiting == 0 and engine.num_steps > 1
            if decode and not times and stats is not None:
                seconds0, bytes0 = dict(stats.seconds), dict(stats.bytes)
            start = time.perf_counter()
            outs = engine.step()
            if decode:
                times.append(time.perf_counter() - start)
            for out in outs:
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        n = len(times)
        comm_ms: dict[str, float] = {}
        comm_bytes: dict[str, int] = {}
        if stats is not None and n:
            for kind in stats.seconds:
                comm_ms[kind] = 1e3 * (stats.seconds[kind] - seconds0.get(kind, 0.0)) / n
                comm_bytes[kind] = (stats.bytes[kind] - bytes0.get(kind, 0)) // n
        return StepCost(tp, n, 1e3 * statistics.median(times), comm_ms, comm_bytes, [tokens[k] for k in sorted(tokens)])
    finally:
        engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="logitpool bench tp", description=__doc__)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    results = [_run(tp, args) for tp in args.sizes]
    print(f"80M Llama, {args.seqs} sequences decoding, prompt {args.prompt_len}, {args.tokens} tokens each")
    print("| TP | decode steps | ms / step (median) | broadcast ms / B | all-reduce ms / B | gather ms / B |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        cells = [
            f"{r.comm_ms[k]:.2f} / {r.comm_bytes[k]:,}" if k in r.comm_ms else "-"
            for k in ("broadcast", "all_reduce", "gather")
        ]
        print(f"| {r.tp} | {r.steps} | {r.step_ms:.1f} | " + " | ".join(cells) + " |")
    same = all(r.tokens == results[0].tokens for r in results)
    print(f"greedy tokens equal across sizes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
