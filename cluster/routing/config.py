"""`routing:` in the config: how the ingress picks a worker replica for each request."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt

Policy = Literal["cache_aware", "power_of_two"]
# Serve's import path of the cache-aware router (the worker deployment's request_router_class).
ROUTER_CLASS = "cluster.routing.router:CacheAwareRouter"
# A replica whose reports stopped for this many stats periods loses its index.
STALE_PERIODS = 5


class RoutingConfig(BaseModel):
    """Routing between worker replicas (cluster.routing; docs/routing.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Policy | None = None
    """cache_aware: to the replica holding the longest cached prefix of the request, unless load is
    imbalanced; power_of_two: Serve's default, the less loaded of two random replicas. None =
    cache_aware when the pool can have more than one worker replica, else power_of_two."""
    imbalance_threshold: NonNegativeInt = 8
    """Ongoing requests a replica may have above the least loaded one and still be preferred for
    its cache."""
    min_match_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    """A cached prefix shorter than this fraction of the request's blocks is no reason to prefer
    a replica."""
    stats_period_s: PositiveFloat = 1.0
    """How often each replica reports its cache and load (Serve's request_routing_stats_period_s)."""
    guess_ttl_s: PositiveFloat = 10.0
    """How long the router assumes a routed request's prompt blocks are cached on its replica
    before that replica's report says so."""
    max_published_blocks: PositiveInt = 4096
    """Block digests per report (8 bytes each), the shallowest first."""

    @property
    def stale_after_s(self) -> float:
        return STALE_PERIODS * self.stats_period_s

    def effective_policy(self, max_replicas: int) -> Policy:
        if self.policy is not None:
            return self.policy
        return "cache_aware" if max_replicas > 1 else "power_of_two"
