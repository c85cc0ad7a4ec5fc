"""`CacheAwareRouter`: Serve's request router for the worker deployment under `routing.policy:
cache_aware` (the deployment's `request_router_config`, cluster.deploy.serve_config).

Serve builds one in every process holding a handle to the worker deployment (the ingress
replicas, a test's driver) and runs it on its router event loop. The ingress calls the worker's
`generate(request_id, prompt, params, scheduling)` with the prompt already tokenized, so the
router reads the token ids from the call itself: it hashes the prompt's blocks
(cluster.routing.blocks), scores each replica by the prefix its last report (and this router's
own guesses) hold (cluster.routing.index) and ranks the replicas (cluster.routing.policy): the
preferred ones first (with none, the less loaded of Serve's power-of-two pair), then that pair.
Serve takes the least loaded replica of the first rank that has room, so a full replica is
passed over, never waited for. A call with no token ids (`info`, a health probe) is routed by
power of two alone.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import weakref
from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.routing.blocks import lookup_blocks, prompt_digests
from cluster.routing.config import RoutingConfig
from cluster.routing.index import PrefixIndex
from cluster.routing.policy import Candidate, Decision, decide
from cluster.routing.report import RoutingReport
from cluster.routing.stats import RouterStats

logger = logging.getLogger(__name__)

# The worker's streaming call and where its prompt is (cluster.worker_deployment.LogitpoolWorker.generate).
GENERATE_METHOD = "generate"
PROMPT_ARG, PROMPT_KWARG = 1, "prompt"
# Guesses per replica, as a multiple of the blocks a report may carry.
GUESSES_PER_PUBLISHED_BLOCK = 4


def request_prompt(request: PendingRequest) -> list[int] | None:
    """The token ids of a `generate` call; None for any other call."""
    if request.metadata.call_method != GENERATE_METHOD:
        return None
    prompt = request.args[PROMPT_ARG] if len(request.args) > PROMPT_ARG else request.kwargs.get(PROMPT_KWARG)
    return prompt if isinstance(prompt, list) and prompt else None


@dataclass
class _Routing:
    """One request on its way: its block digests per block size, and the decision made."""

    tokens: list[int]
    digests: dict[int, list[int]] = field(default_factory=dict)
    decision: Decision | None = None
    guessed: str | None = None  # the replica its blocks were guessed on before Serve placed it

    def full_blocks(self, block_size: int) -> list[int]:
        if block_size not in self.digests:
            self.digests[block_size] = prompt_digests(self.tokens, block_size)
        return self.digests[block_size]

    def lookup(self, block_size: int) -> list[int]:
        """The blocks a replica can serve from its cache (never the one with the last token)."""
        return self.full_blocks(block_size)[: lookup_blocks(len(self.tokens), block_size)]


class CacheAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Longest cached prefix unless load is imbalanced, else power of two (cluster.routing.policy)."""

    def initialize_state(self, **routing: Any) -> None:
        """``routing``: the config's `routing` section (request_router_kwargs)."""
        self._cfg = RoutingConfig.model_validate(routing)
        self._index = PrefixIndex(
            guess_ttl_s=self._cfg.guess_ttl_s,
            stale_after_s=self._cfg.stale_after_s,
            max_guesses=GUESSES_PER_PUBLISHED_BLOCK * self._cfg.max_published_blocks,
        )
        # Per routing attempt (its future; a retry gets a new one): digests and decision, until
        # Serve says where it went. Weak: an attempt cancelled while queued never hears back.
        self._tracked: weakref.WeakKeyDictionary[asyncio.Future[Any], _Routing] = weakref.WeakKeyDictionary()
        # The request each of Serve's routing tasks is routing now (see _fulfill_next_pending_request).
        self._routing_now: weakref.WeakKeyDictionary[asyncio.Task[Any], PendingRequest] = weakref.WeakKeyDictionary()
        self.stats = RouterStats(f"{self._deployment_id.app_name}/{self._deployment_id.name}")

    # -- replicas and their reports --------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's broadcast of the running replicas, each with its latest routing stats."""
        super().update_replicas(replicas)
        now = self._get_curr_time_s()
        self._index.retain(r.replica_id.unique_id for r in replicas)
        new, received = 0, 0
        for r in replicas:
            stats = r.routing_stats
            received += len(pickle.dumps(stats))
            new += self._index.on_report(r.replica_id.unique_id, RoutingReport.from_stats(stats), now)
        self.stats.replica_list(new, received, self._index.sizes(now))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.drop(replica_id.unique_id)

    # -- routing ---------------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        fallback: list[list[RunningReplica]] = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # type: ignore[arg-type]  # Serve's own routers share the mixins' methods this way
            candidate_replicas,
            pending_request,
        )
        if pending_request is None or not fallback:
            return fallback
        task = asyncio.current_task()
        if task is not None:
            self._routing_now[task] = pending_request
        try:
            first = self._first_rank(candidate_replicas, pending_request, fallback[0])
        except Exception:  # routing by cache is an optimisation: fall back to load, never fail
            logger.exception("cache-aware routing failed; routing by load")
            return fallback
        return [first, *fallback] if first else fallback

    def _first_rank(
        self, replicas: list[RunningReplica], request: PendingRequest, pair: list[RunningReplica]
    ) -> list[RunningReplica]:
        """The replicas holding the request's longest prefix; with no preference, the less loaded
        of Serve's pair, taken here so that its blocks are guessed there at once: a request with
        the same prefix routed before this one is placed goes to the same replica."""
        routing = self._track(request)
        if routing is None:
            return []
        now = self._get_curr_time_s()
        candidates, num_blocks = [], 0
        for r in replicas:
            rid = r.replica_id.unique_id
            report = self._index.report(rid, now)
            matched = 0
            if report is not None:
                blocks = routing.lookup(report.block_size)
                num_blocks = max(num_blocks, len(blocks))
                matched = self._index.matched(rid, blocks, now)
            candidates.append(Candidate(rid, self._load(r, report), matched))
        routing.decision = decide(
            candidates,
            num_blocks,
            imbalance_threshold=self._cfg.imbalance_threshold,
            min_match_fraction=self._cfg.min_match_fraction,
        )
        if routing.decision.preferred:
            by_id = {r.replica_id.unique_id: r for r in replicas}
            return [by_id[rid] for rid in routing.decision.preferred]
        loads = {c.replica: c.load for c in candidates}
        target = min(pair, key=lambda r: loads.get(r.replica_id.unique_id, 0))
        self._guess(routing, target.replica_id.unique_id, now, provisional=True)
        return [target]

    def _track(self, request: PendingRequest) -> _Routing | None:
        if request.future in self._tracked:
            return self._tracked[request.future]
        tokens = request_prompt(request)
        if tokens is None:
            return None
        routing = self._tracked[request.future] = _Routing(tokens)
        return routing

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give ``replica`` to the request this routing task chose it for.

        Serve's own matching goes by the internal request id, which every call made while serving
        one ingress request shares (a batch's prompts, each a `generate` call): past the first,
        no call would ever match and each would be routed for ever. Serve's power-of-two router
        does not hit this (its FIFO mixin hands the replica to the oldest waiting call), but
        FIFO would give a replica chosen for one prompt's cache to another prompt.
        """
        task = asyncio.current_task()
        request = self._routing_now.pop(task, None) if task is not None else None
        if request is None or request.future.done():
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        self._record_queue_wait_time(request)
        request.future.set_result(replica)
        if self._pending_requests_by_id.get(request.metadata.internal_request_id) is request:
            self._remove_pending_request_from_indices(request)  # the id's entry, when it is this call's

    def _load(self, replica: RunningReplica, report: RoutingReport | None) -> int:
        """Ongoing requests: Serve's own count (fresh from every reply), else the last report's."""
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            return queued
        return 0 if report is None else report.num_running + report.num_waiting

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The request went to ``replica_id``: count how it was chosen, and guess its blocks there."""
        routing = self._tracked.pop(pending_request.future, None)
        if routing is None:
            return
        rid = replica_id.unique_id
        decision = routing.decision
        self.stats.routed(rid, "cache" if decision is not None and rid in decision.preferred else "load")
        self._guess(routing, rid, self._get_curr_time_s())

    def _guess(self, routing: _Routing, replica: str, now: float, *, provisional: bool = False) -> None:
        """The request's blocks count as cached on ``replica`` (cluster.routing.index); a guess
        made before Serve placed the request moves when it lands elsewhere (that one was full)."""
        if routing.guessed not in (None, replica):
            report = self._index.report(routing.guessed, now)
            if report is not None:
                self._index.unguess(routing.guessed, routing.full_blocks(report.block_size))
        routing.guessed = replica if provisional else None
        report = self._index.report(replica, now)
        if report is not None:
            self._index.guess(replica, routing.full_blocks(report.block_size), now)
