"""`python -m worker.bench.cascade`: one layer's decode attention, cascade against row by row.

B rows share a prefix of P tokens and own S more each (the 80M peer model's attention shape:
12 query heads, 4 KV heads, head_dim 64). Both paths run on the same KV pool, interleaved, and
the median per call is reported; the ratio shows where cascade attention starts to pay
(``worker.model.cascade.cascade_pays``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker.model.attention import DecodeRows, StepMetadata, _decode
from worker.model.cascade import shared_prefix
from worker.model.gather import head_major


def decode_rows(
    batch: int, prefix: int, own: int, block_size: int, kv_heads: int, num_blocks: int, cascade: bool
) -> DecodeRows:
    """Rows sharing ``prefix // block_size`` leading blocks, then ``own`` tokens in blocks of their own."""
    shared = prefix // block_size
    own_blocks = -(-own // block_size)
    table = torch.empty(batch, shared + own_blocks, dtype=torch.long)
    table[:, :shared] = torch.arange(shared)
    table[:, shared:] = shared + torch.randperm(batch * own_blocks)[: batch * own_blocks].view(batch, own_blocks)
    lengths = torch.full((batch,), prefix + own, dtype=torch.long)
    split = shared_prefix(table, lengths, prefix + own, shared, block_size, num_blocks, kv_heads) if cascade else None
    return DecodeRows(
        torch.arange(batch), table, head_major(table.view(-1), kv_heads, num_blocks), lengths, prefix + own, split
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.cascade")
    p.add_argument("--rows", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--prefix-blocks", type=int, nargs="+", default=[1, 2, 4, 8, 48])
    p.add_argument("--own", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, bs = 12, 4, 64, 16
    print("| rows | shared tokens | own tokens | row by row us | cascade us | speed-up |\n|---|---|---|---|---|---|")
    for batch in args.rows:
        for blocks in args.prefix_blocks:
            prefix = blocks * bs
            num_blocks = blocks + batch * -(-args.own // bs)
            k = torch.randn(kv_heads, num_blocks, bs, dim)
            v = torch.randn(kv_heads, num_blocks, bs, dim)
            q = torch.randn(batch, heads, dim)
            metas = [
                StepMetadata(
                    [k],
                    [v],
                    torch.empty(0, dtype=torch.long),
                    decode_rows(batch, prefix, args.own, bs, kv_heads, num_blocks, c),
                    (),
                )
                for c in (False, True)
            ]
            times: list[list[float]] = [[], []]
            with torch.inference_mode():
                for _ in range(args.reps):
                    for which, meta in enumerate(metas):
                        t0 = time.perf_counter()
                        _decode(q, k, v, meta, None, None, None)
                        times[which].append(time.perf_counter() - t0)
            plain, casc = (statistics.median(t) * 1e6 for t in times)
            print(f"| {batch} | {prefix} | {args.own} | {plain:.0f} | {casc:.0f} | {plain / casc:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
