"""`logitpool bench serve`: the same load over HTTP, over gRPC and through the in-process engine.

N concurrent clients (1, 8, 32, 64 by default), each one request of a 128-token prompt and 64
new tokens (greedy, EOS ignored): requests/s, output tokens/s, TTFT and inter-token latency
p50/p99. The in-process `AsyncEngine` runs the same requests in the same run, so the serving
overhead is a ratio. Without `--http`/`--grpc` targets it deploys logitpool locally first (tiny
model, one worker replica with `--worker-cpus` CPUs, the in-process engine on as many threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import httpx
import torch

from client import AsyncClient
from cluster.cli.bench_args import local_deployment
from worker.bench.latency import Latency, Stream, engine_stream, measure


def http_stream(base: str, new_tokens: int, client: httpx.AsyncClient) -> Stream:
    async def run(i: int, prompt: list[int]) -> AsyncIterator[int]:
        body = {
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                yield sum(len(c.get("token_ids") or ()) for c in chunk["choices"])

    return run


def grpc_stream(client: AsyncClient, new_tokens: int) -> Stream:
    async def run(i: int, prompt: list[int]) -> AsyncIterator[int]:
        async for ch in client.stream(prompt, max_tokens=new_tokens, temperature=0.0, ignore_eos=True):
            yield len(ch.token_ids)

    return run


def fmt(name: str, n: int, r: Latency, base: Latency | None) -> str:
    ratio = f"{r.tok_s / base.tok_s:.2f}" if base else "1.00"
    return (
        f"| {n} | {name} | {r.req_s:.2f} | {r.tok_s:.0f} | {r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f} "
        f"| {r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f} | {ratio} |"
    )


async def amain(args: argparse.Namespace) -> None:
    from worker.async_engine import AsyncEngine
    from worker.config import EngineConfig
    from worker.model.loader import embedded_model_path, load_model

    model = args.model or str(embedded_model_path())
    http_base, grpc_target = args.http, args.grpc
    if http_base is None or grpc_target is None:
        from cluster.cli.launch import start_serve, wait_ready
        from cluster.config import LogitpoolConfig

        cfg = LogitpoolConfig.model_validate(
            {
                "engine": {"model": model, "max_num_seqs": max(args.concurrency)},
                "workers": {"num_replicas": 1, "num_cpus": args.worker_cpus},
                "server": {"http_port": args.http_port, "grpc_port": args.grpc_port},
            }
        )
        await asyncio.to_thread(start_serve, cfg)
        await asyncio.to_thread(wait_ready, "127.0.0.1", args.http_port, 300.0)
        http_base, grpc_target = f"http://127.0.0.1:{args.http_port}", f"127.0.0.1:{args.grpc_port}"
    torch.set_num_threads(int(args.worker_cpus))
    loaded = load_model(model, dtype="float32")
    engine = AsyncEngine(
        EngineConfig(model=model, max_num_seqs=max(args.concurrency), load_entry_points=False), loaded=loaded
    )
    g = torch.Generator().manual_seed(0)
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy; ratio = tok/s vs in-process\n")
    print("| N | path | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | vs AsyncEngine |")
    print("|---|---|---|---|---|---|---|")
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as hc, AsyncClient(grpc_target, timeout=600) as gc:
        warm = [torch.randint(10, loaded.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(2)]
        for s in (engine_stream(engine, 4), http_stream(http_base, 4, hc), grpc_stream(gc, 4)):
            await measure(s, warm)
        for n in args.concurrency:
            prompts = [torch.randint(10, loaded.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
            base = await measure(engine_stream(engine, args.new_tokens), prompts)
            print(fmt("AsyncEngine (in-process)", n, base, None), flush=True)
            paths: list[tuple[str, Stream]] = [
                ("gRPC via Serve", grpc_stream(gc, args.new_tokens)),
                ("HTTP via Serve", http_stream(http_base, args.new_tokens, hc)),
            ]
            for name, stream in paths:
                print(fmt(name, n, await measure(stream, prompts), base), flush=True)
    await engine.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="logitpool bench serve")
    p.add_argument("--http", help="base URL of a running deployment (default: deploy locally)")
    p.add_argument("--grpc", help="host:port of its gRPC proxy")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    local_deployment(p, worker_cpus=2.0)
    asyncio.run(amain(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
