"""Options shared by the benchmarks that deploy logitpool locally (`bench serve`, `bench routing`)."""

from __future__ import annotations

import argparse


def local_deployment(p: argparse.ArgumentParser, *, worker_cpus: float) -> None:
    """The model to serve, each worker replica's CPUs, and the ports Serve's proxies listen on."""
    p.add_argument("--model", help="model path (default: the embedded tiny model)")
    p.add_argument("--worker-cpus", type=float, default=worker_cpus)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=9000)
