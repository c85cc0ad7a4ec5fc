"""`python -m worker.bench.static_decode`: the padded static decode path against the dynamic one.

The path a GPU replays as CUDA graphs (``worker.model.static_decode``), run eagerly on CPU: what
padding a batch to its bucket costs there. The 80M peer model loaded twice, one runner with
``cuda_graphs=False`` (dynamic) and one with ``cuda_graphs=True`` (padded, eager on CPU), the
same decode rows; batch sizes between buckets (5, 20) show the padding.
"""

from __future__ import annotations

from worker.bench.fusion import BLOCK, ab_table, bench_args
from worker.bench.peer_model import peer_model_path
from worker.model.loader import load_model
from worker.model.runner import ModelRunner


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m worker.bench.static_decode", [1, 5, 8, 20, 32], argv)
    blocks = max(args.rows) * -(-(args.context + 1) // BLOCK) + 1  # + the padded path's null block
    runners = {
        name: ModelRunner(
            load_model(peer_model_path(), device="cpu", dtype="float32"),
            num_blocks=blocks,
            cuda_graphs=padded,
            max_num_seqs=max(args.rows),
        )
        for name, padded in (("dynamic", False), ("padded", True))
    }
    print(f"80M model, fp32, {args.threads} threads, context {args.context}; median of {args.reps} steps")
    ab_table(runners, args.rows, args.context, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
