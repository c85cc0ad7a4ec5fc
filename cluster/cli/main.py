"""`logitpool serve | status | scale | generate | bench` — heavy imports happen inside each command.

A failing command prints one line naming the problem and exits with 2 (cluster.cli.errors); the
traceback only with `--debug`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.cli.errors import EXIT_BROKEN_PIPE, EXIT_ERROR, CliError, one_line
from cluster.cli.launch import deploy, healthy, start_serve, wait_ready
from worker.config import EngineConfig  # dataclasses only: no heavy import

if TYPE_CHECKING:  # pydantic and the config's imports load only with a command that needs them
    from cluster.config import LogitpoolConfig


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve", parents=[common], help="start (or join) a Ray cluster and serve logitpool until Ctrl-C")
    p.add_argument("--config", type=Path, help="LogitpoolConfig YAML file (flags override it)")
    p.add_argument("--model", help="HF model path or hub id (default: the embedded tiny model)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model's name)")
    p.add_argument("--logits-processors", nargs="+", metavar="FQCN", default=None)
    p.add_argument("--num-replicas", type=int)
    p.add_argument("--autoscale", nargs=2, type=int, metavar=("MIN", "MAX"))
    p.add_argument("--num-gpus", type=float, help="GPUs per worker replica (default: 1 with --address, else 0)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int)
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--address", help="Ray cluster to join (e.g. auto, ray://host:10001); default: start a local one")
    p.add_argument("--max-num-seqs", type=int, help=f"rows per worker batch (default {EngineConfig.max_num_seqs})")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        help=f"ranks each worker replica shards the model over (default {EngineConfig.tensor_parallel_size})",
    )
    p.add_argument("--session", type=Path, help="where `status`/`scale` find this server (default: the cache's)")


def build_config(args: argparse.Namespace) -> LogitpoolConfig:
    from cluster.config import LogitpoolConfig

    cfg = LogitpoolConfig.from_yaml(args.config) if args.config else LogitpoolConfig()
    o: dict[str, Any] = {}
    if args.model:
        o["engine.model"] = args.model
    if getattr(args, "served_model_name", None):
        o["served_model_name"] = args.served_model_name
    if args.logits_processors is not None:
        o["engine.logits_processors"] = tuple(args.logits_processors)
    if args.max_num_seqs:
        o["engine.max_num_seqs"] = args.max_num_seqs
    if getattr(args, "tensor_parallel_size", None) is not None:
        o["engine.tensor_parallel_size"] = args.tensor_parallel_size
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


def check_processors(cfg: LogitpoolConfig) -> None:
    """Import every configured logits processor here, in seconds, before any Ray process starts
    (a worker replica would otherwise fail the same import, after Serve's retries)."""
    from worker.logits_processor.registry import resolve_processor_class

    for spec in cfg.engine.logits_processors:
        fqcn = spec if isinstance(spec, str) else f"{spec.__module__}.{spec.__qualname__}"
        try:
            resolve_processor_class(spec)
        except Exception as exc:
            text = str(exc).strip()
            raise CliError(text if fqcn in text else f"logits processor {fqcn}: {one_line(exc)}") from exc


def check_model(cfg: LogitpoolConfig) -> None:
    model = cfg.engine.model
    if model is not None and model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        raise CliError(f"model: no such directory: {model}")


def _command_name() -> str:
    """How this CLI was invoked, so the banner's examples run as printed (no PATH assumed)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return shlex.quote(argv0) if Path(argv0).name == "logitpool" else f"{shlex.quote(sys.executable)} -m cluster.cli"


def banner(
    cfg: LogitpoolConfig, host: str, keys: bool, session_path: Path | None = None, status: bool = True
) -> list[str]:
    http = f"http://{host}:{cfg.server.http_port}"
    first_key = f"${{{cfg.api_key_env}%%,*}}"  # the variable may hold several keys: the first one
    auth = f' -H "Authorization: Bearer {first_key}"' if keys else ""
    key_flag = f' --api-key "{first_key}"' if keys else ""
    session = f" --session {shlex.quote(str(session_path))}" if session_path is not None else ""
    lines = [
        f"logitpool is serving {cfg.engine.model} as model {cfg.served_name!r}",
        f"  HTTP (OpenAI-compatible): {http}/v1   gRPC: {host}:{cfg.server.grpc_port}",
    ]
    if cfg.server.host not in ("0.0.0.0", "::"):
        lines.append(
            f"  note: Ray Serve's gRPC proxy listens on every interface ([::]:{cfg.server.grpc_port}) whatever "
            "--host says; set API keys (LOGITPOOL_API_KEY) or firewall the port"
        )
    if keys:
        lines.append(f"  API keys are on: clients send one of the keys in ${cfg.api_key_env}")
    lines += [
        f"  processors: {http}/v1/processors   health: {http}/health   metrics: {http}/metrics",
        "Try:",
        f"  curl {http}/v1/completions -H 'Content-Type: application/json'{auth} "
        '-d \'{"prompt": "def main(", "max_tokens": 16}\'',
        f"  {_command_name()} generate 'def main(' --target {host}:{cfg.server.grpc_port}{key_flag}",
    ]
    if status:
        lines += [
            f"  {_command_name()} status{session}        # replicas, requests and KV cache per worker replica",
            f"  {_command_name()} scale 2{session}       # redeploy with 2 worker replicas",
        ]
    lines.append("Ctrl-C to stop.")
    return lines


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.cli import session

    cfg = build_config(args)
    check_model(cfg)
    check_processors(cfg)
    cfg = start_serve(cfg, args.address)
    import ray

    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    wait_ready(host, cfg.server.http_port)
    path = _session_path(args)
    session_path: Path | None = path
    if session.owned_by_another(path):
        print(
            f"note: another `logitpool serve` owns {path}; `status`/`scale` of this one are not "
            "available (start it with --session PATH)",
            file=sys.stderr,
        )
        session_path = None
    else:
        session.write(path, ray.get_runtime_context().gcs_address, cfg.model_dump(mode="json", exclude={"api_keys"}))
    print(
        "\n".join(
            banner(
                cfg,
                host,
                bool(cfg.resolve_api_keys(os.environ)),
                args.session if session_path else None,
                status=session_path is not None,
            )
        ),
        flush=True,
    )
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        if session_path is not None:
            session.remove(session_path)
        from ray import serve

        # The application's replicas stop gracefully; a local cluster then goes down with this
        # process (serve.shutdown() first would only race Ray's own teardown of its controller
        # and log "graceful_shutdown failed"). A joined cluster keeps running without our app.
        serve.delete(cfg.app_name)
        ray.shutdown()
    return 0


def _session_path(args: argparse.Namespace) -> Path:
    from cluster.cli import session

    return args.session or session.default_path()


def cmd_status(args: argparse.Namespace) -> int:
    import asyncio

    from cluster import pool_stats
    from cluster.cli import session
    from cluster.cli.deploy_wait import app_status
    from cluster.cli.status_view import status_lines

    data = session.join(_session_path(args))
    app = data["config"]["app_name"]
    print("\n".join(status_lines(app, app_status(app), asyncio.run(pool_stats.collect(app)))))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from cluster.cli import session
    from cluster.config import LogitpoolConfig

    if args.replicas < 1:
        raise CliError(f"replicas: must be >= 1, got {args.replicas}")
    data = session.join(_session_path(args))
    cfg = scaled_config(LogitpoolConfig.model_validate(data["config"]), args.replicas)
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    deploy(cfg, serving=lambda: healthy(host, cfg.server.http_port))
    data["config"] = cfg.model_dump(mode="json", exclude={"api_keys"})
    session.update(_session_path(args), data)
    print(f"{cfg.app_name}: {args.replicas} worker replica(s)")
    return 0


def scaled_config(running: LogitpoolConfig, replicas: int) -> LogitpoolConfig:
    """The running pool's config at ``replicas`` fixed worker replicas. An unset routing policy
    defaults by the pool's size, and a change of policy redeploys every worker (they publish
    their cached blocks only under cache-aware routing): scaling down keeps cache-aware routing,
    so it stops replicas and restarts none. Scaling up from one replica still switches it on."""
    from cluster.deploy.serve_config import routing_policy

    overrides: dict[str, Any] = {"workers.num_replicas": replicas, "workers.autoscaling": None}
    if running.routing.policy is None and routing_policy(running) == "cache_aware":
        overrides["routing.policy"] = "cache_aware"
    return running.with_overrides(**overrides)


def _first_env_key() -> str | None:
    """The first of the comma-separated keys in LOGITPOOL_API_KEY (what the server accepts)."""
    from cluster.config import LogitpoolConfig

    keys = LogitpoolConfig().resolve_api_keys(os.environ)
    return keys[0] if keys else None


def cmd_generate(args: argparse.Namespace) -> int:
    from client import Client

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.extra_args:
        try:
            sampling["extra_args"] = json.loads(args.extra_args)
        except ValueError as exc:
            raise CliError(f"--extra-args: not valid JSON ({exc})") from None
    from client.errors import LogitpoolError

    try:
        with Client(args.target, api_key=args.api_key or _first_env_key(), timeout=args.timeout) as c:
            finish = None
            for chunk in c.stream(args.prompt, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                finish = chunk.finish_reason or finish
    except LogitpoolError as exc:
        raise CliError(f"{args.target}: {type(exc).__name__}: {one_line(CliError(str(exc)))}") from exc
    print(f"\n[finish_reason={finish}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The CLI; a reader that closes the pipe (``logitpool generate ... | head``) ends it quietly,
    with 128 + SIGPIPE as every Unix tool does."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python flushes stdout at exit; point it at /dev/null so that flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="logitpool")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub, common)
    for name, text in (
        ("status", "replicas, running/waiting requests and KV cache of the running `logitpool serve`"),
        ("scale", "redeploy the running `logitpool serve` with N worker replicas"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        if name == "scale":
            p.add_argument("replicas", type=int)
        p.add_argument("--session", type=Path, help="session file of the `logitpool serve` (default: the cache's)")
    g = sub.add_parser("generate", parents=[common], help="one streamed request over gRPC")
    g.add_argument("prompt")
    g.add_argument("--target", default="127.0.0.1:9000")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--extra-args", help="JSON object for custom logits processors")
    g.add_argument("--api-key")
    g.add_argument("--timeout", type=float, default=120.0)
    b = sub.add_parser(
        "bench", help="benchmarks: sampler | engine | serve | soak | processors | structured | routing | tp"
    )
    b.add_argument("what", choices=["sampler", "engine", "serve", "soak", "processors", "structured", "routing", "tp"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd != "bench":
        try:
            return {"serve": cmd_serve, "status": cmd_status, "scale": cmd_scale, "generate": cmd_generate}[args.cmd](
                args
            )
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is the operator's one line
            if args.debug:
                traceback.print_exc()
            print(f"logitpool: error: {one_line(exc)}", file=sys.stderr)
            return EXIT_ERROR
    if args.what == "sampler":
        from worker.bench.sampler import main as bench_main
    elif args.what == "engine":
        from worker.bench.engine import main as bench_main
    elif args.what == "soak":
        from cluster.cli.bench_soak import main as bench_main
    elif args.what == "processors":
        from worker.bench.processors import main as bench_main
    elif args.what == "structured":
        from worker.bench.structured import main as bench_main
    elif args.what == "routing":
        from cluster.cli.bench_routing import main as bench_main
    elif args.what == "tp":
        from worker.bench.tensor_parallel import main as bench_main
    else:
        from cluster.cli.bench_serve import main as bench_main
    return bench_main(args.rest) or 0


if __name__ == "__main__":
    sys.exit(main())
