"""Serve replicas' inter-deployment gRPC server binds the node address, not every interface.

Ray Serve 2.60 starts a gRPC server in every replica (`ReplicaActor._on_initialized`) on
`[::]:0`, hard-coded, and serves requests to the replica on it without Ray's token check. Callers
reach it at the replica's node IP (the router's `RunningReplicaInfo.node_ip`), so binding that
address alone changes nothing for Serve and closes the port to other interfaces (on a local
`logitpool serve` the node address is loopback). Called from our deployments' constructors,
which run in the replica process before the server is started.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)


def bind_replica_grpc_to_node_ip() -> None:
    try:
        import ray
        from ray.serve._private import replica
    except ImportError:
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "__module__", None) == __name__:  # ours: already bound
        return
    node_ip = ray.util.get_node_ip_address()
    host = f"[{node_ip}]" if ":" in node_ip else node_ip

    def add_port(server: grpc.aio.Server, address: str) -> int:
        if address.startswith("[::]:"):
            address = f"{host}:{address[5:]}"
        return original(server, address)

    replica.add_port_to_grpc_server = add_port
