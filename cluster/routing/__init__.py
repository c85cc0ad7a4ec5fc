"""Routing between worker replicas: each request to the replica whose prefix cache holds most of
its prompt, unless that replica is overloaded (docs/routing.md).

- `blocks`: the process-independent digest of a KV block, chained like the worker's address.
- `report`: what a replica publishes (Serve routing stats): its cached digests, bounded, and load.
- `index`: the router's view of every replica's cache: reports plus its own short-lived guesses.
- `policy`: the choice, a pure function.
- `router`: the Serve `RequestRouter` that puts them together (routing.policy: cache_aware).
- `config`, `stats`: the `routing:` config section; counters for /metrics.
"""
