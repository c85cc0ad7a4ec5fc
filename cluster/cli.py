"""`logitpool serve | generate | bench` — heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 600.0
LOCAL_NUM_CPUS = 8
# Largest gRPC message Serve's proxy takes or sends; requests past limits.max_body_bytes are
# rejected anyway, responses (logprobs of long generations) need more room.
GRPC_MAX_MESSAGE_BYTES = 64 << 20


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="start (or join) a Ray cluster and serve logitpool until Ctrl-C")
    p.add_argument("--config", type=Path, help="LogitpoolConfig YAML file (flags override it)")
    p.add_argument("--model", help="HF model path or hub id (default: the embedded tiny model)")
    p.add_argument("--logits-processors", nargs="+", metavar="FQCN", default=None)
    p.add_argument("--num-replicas", type=int)
    p.add_argument("--autoscale", nargs=2, type=int, metavar=("MIN", "MAX"))
    p.add_argument("--num-gpus", type=float, help="GPUs per worker replica (default: 1 with --address, else 0)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int)
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--address", help="Ray cluster to join (e.g. auto, ray://host:10001); default: start a local one")
    p.add_argument("--max-num-seqs", type=int)


def build_config(args: argparse.Namespace) -> Any:
    from cluster.config import LogitpoolConfig

    cfg = LogitpoolConfig.from_yaml(args.config) if args.config else LogitpoolConfig()
    o: dict[str, Any] = {}
    if args.model:
        o["engine.model"] = args.model
    if args.logits_processors is not None:
        o["engine.logits_processors"] = tuple(args.logits_processors)
    if args.max_num_seqs:
        o["engine.max_num_seqs"] = args.max_num_seqs
    if args.num_replicas is not None:
        o["workers.num_replicas"] = args.num_replicas
        o["workers.autoscaling"] = None
    if args.autoscale:
        lo, hi = args.autoscale
        o["workers.autoscaling"] = {"min_replicas": lo, "max_replicas": hi}
        o["workers.num_replicas"] = None
    if args.num_gpus is not None:
        o["workers.num_gpus"] = args.num_gpus
    elif getattr(args, "address", None) and "num_gpus" not in cfg.workers.model_fields_set:
        # Joining a real cluster: one GPU per worker replica unless said otherwise (the embedded
        # local default stays on CPU).
        o["workers.num_gpus"] = 1.0
    for flag, key in (("host", "server.host"), ("http_port", "server.http_port"), ("grpc_port", "server.grpc_port")):
        if getattr(args, flag) is not None:
            o[key] = getattr(args, flag)
    return cfg.with_overrides(**o) if o else cfg


def local_cluster_env(cfg: Any, token_dir: Path | None = None) -> dict[str, str]:
    """Environment for a Ray cluster this CLI starts itself (set before Ray is imported).

    - Every Ray listener (GCS, raylet, object manager, agents, workers) binds the node address,
      which is loopback unless `server.host` asks for all interfaces: Ray then treats the node
      as a single-machine cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes its node address
      the loopback one; that variable only decides this).
    - Token authentication on (RAY_AUTH_MODE=token) with a fresh random token per start, in a
      file only this user can read; RAY_AUTH_MODE=disabled set by the caller is respected (the
      test suite does, for its own clusters) and warned about.
    - Serve's HTTP proxy gets the request read timeout (cluster.slow_clients), and its gRPC proxy
      a message size bound (Serve's default is 2 GiB, parsed in memory before any check of ours).
    """
    from cluster.slow_clients import proxy_env

    env = dict(proxy_env(cfg.limits.read_timeout_s))
    env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(GRPC_MAX_MESSAGE_BYTES)
    if cfg.server.host in ("127.0.0.1", "localhost", "::1"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        print("warning: RAY_AUTH_MODE=disabled: the local Ray cluster accepts unauthenticated clients",
              file=sys.stderr)
        return env
    import atexit
    import secrets
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="logitpool-ray-auth-", dir=token_dir))  # mode 0700
    atexit.register(shutil.rmtree, directory, True)  # the token lives as long as this cluster
    token = directory / "auth_token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    os.environ.pop("RAY_AUTH_TOKEN", None)
    return env


def start_serve(cfg: Any, address: str | None = None) -> Any:
    """Start/join Ray, start Serve's HTTP and gRPC proxies, deploy; returns the resolved config."""
    if address is None and "ray" not in sys.modules:
        os.environ.update(local_cluster_env(cfg))
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.serve_config import GRPC_SERVICER_FUNCTIONS

    if not ray.is_initialized():
        if address is None:
            # A local cluster: logical CPUs are scheduling slots, not cores; leave room for the
            # ingress and a few worker replicas even on a 2-core laptop. Nothing listens beyond
            # the node address (see local_cluster_env); the dashboard is off.
            ray.init(num_cpus=max(os.cpu_count() or 1, LOCAL_NUM_CPUS), include_dashboard=False,
                     log_to_driver=False, dashboard_host="127.0.0.1")
        else:
            ray.init(address=address, log_to_driver=False)
    serve.start(
        http_options={"host": cfg.server.host, "port": cfg.server.http_port},
        grpc_options=gRPCOptions(port=cfg.server.grpc_port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS)),
    )
    return deploy(cfg)


def deploy(cfg: Any) -> Any:
    """(Re)deploy the application on a running Serve instance; returns the resolved config."""
    from ray import serve

    from cluster.app import build_app, resolve_model

    cfg = resolve_model(cfg)
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
    return cfg


def wait_ready(host: str, port: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"logitpool did not become healthy within {timeout_s:.0f}s")


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    cfg = start_serve(cfg, args.address)
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    wait_ready(host, cfg.server.http_port)
    http = f"http://{host}:{cfg.server.http_port}"
    print(f"logitpool is serving {cfg.engine.model}")
    print(f"  HTTP (OpenAI-compatible): {http}/v1   gRPC: {host}:{cfg.server.grpc_port}")
    if cfg.server.host not in ("0.0.0.0", "::"):
        print(f"  note: Ray Serve's gRPC proxy listens on every interface ([::]:{cfg.server.grpc_port}) whatever "
              "--host says; set API keys (LOGITPOOL_API_KEY) or firewall the port")
    print(f"  processors: {http}/v1/processors   health: {http}/health   metrics: {http}/metrics")
    print("Try:")
    print(f"  curl {http}/v1/completions -H 'Content-Type: application/json' "
          "-d '{\"prompt\": \"def main(\", \"max_tokens\": 16}'")
    print(f"  logitpool generate 'def main(' --target {host}:{cfg.server.grpc_port}")
    print("Ctrl-C to stop.", flush=True)
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    while not stop:
        time.sleep(0.5)
    from ray import serve

    serve.shutdown()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from client import Client

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.extra_args:
        sampling["extra_args"] = json.loads(args.extra_args)
    with Client(args.target, api_key=args.api_key or os.environ.get("LOGITPOOL_API_KEY"), timeout=args.timeout) as c:
        finish = None
        for chunk in c.stream(args.prompt, **sampling):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            finish = chunk.finish_reason or finish
    print(f"\n[finish_reason={finish}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="logitpool")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    g = sub.add_parser("generate", help="one streamed request over gRPC")
    g.add_argument("prompt")
    g.add_argument("--target", default="127.0.0.1:9000")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--extra-args", help="JSON object for custom logits processors")
    g.add_argument("--api-key")
    g.add_argument("--timeout", type=float, default=120.0)
    b = sub.add_parser("bench", help="benchmarks: sampler | engine | serve | soak | processors | structured")
    b.add_argument("what", choices=["sampler", "engine", "serve", "soak", "processors", "structured"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        return cmd_serve(args)
    if args.cmd == "generate":
        return cmd_generate(args)
    if args.what == "sampler":
        from worker.bench.sampler import main as bench_main
    elif args.what == "engine":
        from worker.bench.engine import main as bench_main
    elif args.what == "soak":
        from cluster.bench_soak import main as bench_main
    elif args.what == "processors":
        from worker.bench.processors import main as bench_main
    elif args.what == "structured":
        from worker.bench.structured import main as bench_main
    else:
        from cluster.bench_serve import main as bench_main
    return bench_main(args.rest) or 0


if __name__ == "__main__":
    sys.exit(main())
