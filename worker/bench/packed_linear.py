"""`python -m worker.bench.packed_linear`: CPU decode steps on MKL's packed weights against without.

Default: the 80M peer model loaded twice, one runner with ``packed_weights=False`` and one with
``True`` (both fused as the engine fuses on CPU), the same B decode rows at a context of L tokens,
calls alternating (``worker.bench.fusion.ab_table``).

``--gemms``: the GEMMs alone, ``F.linear`` against ``PackedLinear`` at the model's linear shapes
(read from its config: the fused q/k/v, o, gate, up, down), M rows each, summed over the five:
the measurement behind ``PACKED_ROWS``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.bench.fusion import alternating_medians, bench_args, bench_main
from worker.bench.peer_model import peer_model_path
from worker.model.packed_linear import PACKED_ROWS, PackedLinear


def _layer_shapes() -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears as the CPU engine runs them."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(peer_model_path())
    hidden, inter, head_dim = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    attn_out = cfg.num_attention_heads * head_dim
    return [(qkv, hidden), (attn_out, hidden), (inter, hidden), (inter, hidden), (hidden, inter)]


def _forced(linear: PackedLinear, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The packed kernel at any row count (PackedLinear itself takes it only at PACKED_ROWS)."""
    return lambda x: torch.ops.mkl._mkl_linear(x, linear.packed, linear.weight, None, rows)


def _all(calls: list[Callable[[torch.Tensor], torch.Tensor]], xs: list[torch.Tensor]) -> None:
    for call, x in zip(calls, xs):
        call(x)


def gemm_table(rows: list[int], reps: int) -> None:
    """Median ms of one layer's five GEMMs, F.linear against packed, M rows (the packed kernel
    forced at every M, so the table shows where ``PACKED_ROWS`` should end)."""
    shapes = _layer_shapes()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) / k**0.5 for n, k in shapes]
    packed = [PackedLinear(w, None) for w in weights]
    print("one layer's linears: " + ", ".join(f"{k} -> {n}" for n, k in shapes))
    span = f"{PACKED_ROWS.start}..{PACKED_ROWS.stop - 1}"
    print(f"| M | F.linear ms | packed ms | packed speed-up | in PACKED_ROWS ({span}) |")
    print("|---|---|---|---|---|")
    for m in rows:
        xs = [torch.randn(m, k, generator=g) for _, k in shapes]
        plain: list[Callable[[torch.Tensor], torch.Tensor]] = [functools.partial(F.linear, weight=w) for w in weights]
        forced: list[Callable[[torch.Tensor], torch.Tensor]] = [_forced(p, m) for p in packed]
        with torch.inference_mode():
            ms = alternating_medians(
                {"plain": functools.partial(_all, plain, xs), "packed": functools.partial(_all, forced, xs)},
                reps,
                inner=max(3, 2000 // m),
            )
        inside = "yes" if m in PACKED_ROWS else "no"
        ratio = ms["plain"] / ms["packed"]
        print(f"| {m} | {ms['plain']:.3f} | {ms['packed']:.3f} | {ratio:.2f}x | {inside} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m worker.bench.packed_linear", [1, 4, 8, 32, 64], argv, gemms=True)
    return bench_main(args, gemm_table, "packed_weights", ("unpacked", "packed"))


if __name__ == "__main__":
    raise SystemExit(main())
