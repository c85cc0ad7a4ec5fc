"""`python -m worker.bench.compare --old TREE`: this checkout's engine against another, A/B/A/B.

Both engines run one workload (``engine_child.py``: uniform, N prompts of 128 tokens, 128 new;
or ``--workload shared``, N prompts of one ``--prompt``-token prefix and ``--own`` tokens each;
greedy, ``LLM.generate``) in fresh subprocesses, alternating, so load from other processes on a
shared machine falls on both alike. Reports each round's tok/s, the median ratio new/old per N,
and whether both produced the same tokens (they must: greedy, same model, same prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from worker.bench.peer_model import peer_model_path
from worker.model.loader import embedded_model_path

HERE = Path(__file__).resolve().parents[2]  # this checkout's root


def run_tree(tree: Path, spec: dict, timeout_s: float) -> dict[str, dict]:
    """The child under ``tree``'s ``worker`` package (PYTHONPATH first, so it wins over the install)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    child = Path(__file__).with_name("engine_child.py")
    proc = subprocess.run(  # check=False: a failed child's stderr is the error below
        [sys.executable, str(child), json.dumps(spec)],
        env=env,
        cwd=tree,
        timeout=timeout_s,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.compare")
    p.add_argument("--old", required=True, help="root of the other checkout (e.g. a git worktree)")
    p.add_argument("--model-size", choices=["tiny", "80m"], default="tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workload", choices=["uniform", "shared"], default="uniform")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (shared: the common prefix)")
    p.add_argument("--own", type=int, default=32, help="shared: each prompt's own tokens after the prefix")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--new-engine",
        type=json.loads,
        default={},
        help='engine fields for the new side, JSON ({"fused_layers": false})',
    )
    p.add_argument("--old-engine", type=json.loads, default={}, help="engine fields for the old side, JSON")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child run")
    args = p.parse_args(argv)
    model = peer_model_path() if args.model_size == "80m" else embedded_model_path()
    spec = {
        "model": str(model),
        "concurrency": args.concurrency,
        "budget": 2048,
        "max_model_len": 1024,
        "workload": args.workload,
        "prompt": args.prompt,
        "own": args.own,
        "new": args.new,
        "threads": args.threads,
    }
    trees = {"new": HERE, "old": Path(args.old).resolve()}
    runs: dict[str, list[dict]] = {"new": [], "old": []}
    for r in range(args.rounds):
        for name in ("new", "old") if r % 2 == 0 else ("old", "new"):
            engine = args.new_engine if name == "new" else args.old_engine
            runs[name].append(run_tree(trees[name], {**spec, "engine": engine}, args.timeout))
            rates = ", ".join(f"N={n} {v['tok_s']:.0f} tok/s" for n, v in runs[name][-1].items())
            print(f"round {r + 1} {name}: {rates}", flush=True)
    print(
        f"\n{args.model_size} model, {args.workload}, prompt {args.prompt}"
        f"{f' + {args.own} own' if args.workload == 'shared' else ''}, {args.new} new, greedy, {args.threads} threads; "
        f"{args.rounds} alternating rounds\n"
    )
    print("| N | new tok/s (rounds) | old tok/s (rounds) | new / old (median of rounds) | same tokens |")
    print("|---|---|---|---|---|")
    for n in map(str, args.concurrency):
        new = [run[n]["tok_s"] for run in runs["new"]]
        old = [run[n]["tok_s"] for run in runs["old"]]
        ratio = statistics.median(a / b for a, b in zip(new, old))
        same = len({run[n]["digest"] for run in runs["new"] + runs["old"]}) == 1
        print(
            f"| {n} | {' / '.join(f'{x:.0f}' for x in new)} | {' / '.join(f'{x:.0f}' for x in old)} "
            f"| {ratio:.2f}x | {'yes' if same else 'NO'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
