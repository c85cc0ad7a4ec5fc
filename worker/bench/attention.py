"""`python -m worker.bench.attention`: one layer's decode step, torch backend against flex.

B decode rows, each with a context of L tokens in blocks scattered over a shuffled pool of
exactly B * L tokens (the 80M peer model's attention shape: 12 query heads, 4 KV heads, head_dim
64, blocks of 16). Each call is a whole layer's attention as the engine runs it (fresh step
metadata, so the torch path's masks and the flex plan are built each time; the KV write included).
The median per call is reported. ``--cpu-compile`` runs flex compiled on CPU too (the first call
compiles: reported apart).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker.model import flex_attention
from worker.model.attention import AttentionBackend, DecodeRows, StepMetadata, paged_kv_attention
from worker.model.gather import head_major

HEADS, KV_HEADS, DIM, BLOCK = 12, 4, 64, 16


class _Layer(torch.nn.Module):
    layer_idx = 0  # what the attention function reads of its module


def _step(batch: int, context: int, k: torch.Tensor, v: torch.Tensor, backend: AttentionBackend) -> StepMetadata:
    per_row = context // BLOCK
    num_blocks = k.shape[1]
    table = torch.randperm(num_blocks)[: batch * per_row].view(batch, per_row)
    lengths = torch.full((batch,), context, dtype=torch.long)
    rows = DecodeRows(torch.arange(batch), table, head_major(table.view(-1), KV_HEADS, num_blocks), lengths, context)
    slots = table[:, -1] * BLOCK + BLOCK - 1
    return StepMetadata([k], [v], slots, rows, (), {}, None, backend)


def _time(batch: int, context: int, backend: AttentionBackend, reps: int) -> tuple[float, float]:
    """(first call s, median of the rest in ms)."""
    num_blocks = batch * context // BLOCK
    k, v = torch.randn(KV_HEADS, num_blocks, BLOCK, DIM), torch.randn(KV_HEADS, num_blocks, BLOCK, DIM)
    q = torch.randn(1, HEADS, batch, DIM)
    new_k, new_v = torch.randn(1, KV_HEADS, batch, DIM), torch.randn(1, KV_HEADS, batch, DIM)
    layer = _Layer()
    times = []
    for _ in range(reps + 1):
        meta = _step(batch, context, k, v, backend)
        start = time.perf_counter()
        with torch.inference_mode():
            paged_kv_attention(layer, q, new_k, new_v, None, logitpool_step=meta)
        times.append(time.perf_counter() - start)
    return times[0], 1e3 * statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.attention")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--eager-reps", type=int, default=3, help="eager flex is slow: fewer calls")
    p.add_argument("--cpu-compile", action="store_true", help="also flex compiled on CPU")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = ["torch", "flex eager"] + (["flex compiled"] if args.cpu_compile else [])
    print("| rows | context | " + " | ".join(f"{name} ms" for name in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for batch in args.rows:
        for context in args.context:
            cells = []
            for name in variants:
                if name == "flex compiled":
                    flex_attention.COMPILED_DEVICES["cpu"] = "inductor"
                backend: AttentionBackend = "torch" if name == "torch" else "flex"
                try:
                    first, median = _time(
                        batch, context, backend, args.eager_reps if name == "flex eager" else args.reps
                    )
                except Exception as e:  # noqa: BLE001  # torch's CPU compile of flex can fail: reported, not fatal
                    cells.append(f"fails: {type(e).__name__}")
                    continue
                finally:
                    flex_attention.COMPILED_DEVICES.pop("cpu", None)
                cells.append(f"{median:.2f}" + (f" (first {first:.1f} s)" if name == "flex compiled" else ""))
            print(f"| {batch} | {context} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
