"""`python -m worker.bench.host_prep`: a step's host preparation in the model runner, no forward.

What the runner does on the host before it launches a step (validate the step, bring the
persistent block table in step, build the per-token index tensors and the attention metadata),
for steady decode steps: every row one token further, and one row in ``BLOCK`` crossing into a
new block each step. On a GPU this is host time the device waits for; it should grow with the
rows, not with rows x blocks. The tiny model (no forward runs; the KV pool only has to exist).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker.model.loader import build_tiny_model, default_model_path, load_model
from worker.model.runner import ModelRunner, ScheduledSeq

BLOCK = 16


def prepare(runner: ModelRunner, seqs: list[ScheduledSeq]) -> None:
    """The runner's host work for one dynamic step (``ModelRunner.execute`` less the forward)."""
    with torch.inference_mode():
        used = runner._check(seqs)
        runner._sync_table(seqs, used)
        runner._metadata(seqs, used)


def step_ms(rows: int, context: int, steps: int) -> float:
    """Median host-prep ms of a decode step at ``rows`` rows of ``context`` tokens."""
    max_len = context + steps + BLOCK
    per_row = -(-max_len // BLOCK)
    loaded = load_model(build_tiny_model(default_model_path()), device="cpu", dtype="float32")
    runner = ModelRunner(loaded, num_blocks=rows * per_row, block_size=BLOCK, max_model_len=max_len)
    tables = [list(range(r * per_row, r * per_row + -(-(context + 1) // BLOCK))) for r in range(rows)]
    times = []
    for t in range(steps):
        pos = context + t
        seqs = []
        for r, table in enumerate(tables):
            p = pos + r % BLOCK  # rows cross block boundaries on different steps
            while len(table) * BLOCK <= p:
                table.append(r * per_row + len(table))
            seqs.append(ScheduledSeq(table, [7], p, True))
        start = time.perf_counter()
        prepare(runner, seqs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[steps // 4 :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.bench.host_prep")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024, 1900])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"host prep per decode step, ms (median of {args.steps} steps, block {BLOCK})")
    print("| rows | " + " | ".join(f"context {c}" for c in args.context) + " |")
    print("|---|" + "---|" * len(args.context))
    for rows in args.rows:
        cells = [f"{step_ms(rows, c, args.steps):.2f}" for c in args.context]
        print(f"| {rows} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
