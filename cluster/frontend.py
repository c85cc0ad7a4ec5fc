"""The transport-free front end: validation, tokenization, dispatch, streaming and readiness.

HTTP (cluster.openai.adapter) and gRPC (cluster.rpc.service) are thin adapters that each hold
one `Frontend`: they turn their wire format into `SamplingParams` + prompts and back, and
everything in between happens here, once, for both. Every request is validated (limits, the
standard rules and every loaded processor's ``validate_params``) and tokenized here; a bad
request never reaches a worker, and the worker receives token ids (see cluster.worker_deployment).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import AutoTokenizer

from cluster import limits as request_limits
from cluster import pool_stats, prompt_bound
from cluster import request_id as request_ids
from cluster.auth import ApiKeys, bearer_token
from cluster.chat import (
    CHAT_TOKENS,
    GENERATION_PROMPT,
    TEXT_TOKENS,
    ChatRender,
    PromptTokens,
    Turn,
    fit_to_context,
    render_chat,
)
from cluster.config import LogitpoolConfig
from cluster.errors import ModelNotFound, RequestFailed, Status, replica_unavailable
from cluster.limits import ONCE, ResponseShape
from cluster.metrics import LOCAL_REPLICA, IngressSnapshot, Metrics
from worker.logits_processor.registry import LogitsProcessors, build_logits_processors
from worker.model.loader import model_limits
from worker.outputs import OutputAccumulator, RequestOutput
from worker.request import Scheduling
from worker.sampling_params import SamplingParams
from worker.validation import RequestValidator

logger = logging.getLogger(__name__)

# Upper bound on one request end to end; nothing waits forever.
REQUEST_TIMEOUT_S = 600.0
# Retries of a request whose worker replica was unavailable before it produced anything; the
# backoff adds up to a few seconds, past the time a dead replica takes to leave the routers.
REPLICA_RETRIES = 5
REPLICA_RETRY_BACKOFF_S = 0.2

# Every worker replica's engine stats (cluster.pool_stats snapshots); [] when none is known.
PoolReader = Callable[[], Awaitable[list[pool_stats.PoolSnapshot]]]
# Every ingress replica's published metrics (cluster.metrics.shared); [] when none is known.
PeerReader = Callable[[], Awaitable[list[IngressSnapshot]]]


def check_prompts(prompts: list[str | list[int]]) -> None:
    """At least one prompt, none empty (text or token ids), before anything is tokenized: a
    tokenizer that adds a BOS token would otherwise make an empty prompt valid on one path."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompt: must not be empty")


# Prompts up to this many characters (or token ids) in all are checked on the event loop: less
# work than a hop to a thread. Longer ones are tokenized (and chat templates rendered) on one of
# TOKENIZE_THREADS threads, so /health and other requests never wait behind them.
INLINE_PROMPT_CHARS = 4096
TOKENIZE_THREADS = 2
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """A checked request, ready to dispatch: its frozen params (max_tokens fitted to the
    context) and each prompt's token ids."""

    params: SamplingParams
    prompts: list[list[int]]

    @property
    def ids(self) -> list[int]:
        """The one prompt's ids (chat, gRPC)."""
        (ids,) = self.prompts
        return ids


class Frontend:
    """One per ingress replica; `worker` is the worker deployment's handle (a DeploymentHandle,
    real or from Serve's local testing mode), `pool` reads the worker replicas' stats, `peers`
    the ingress replicas' metrics (None: this replica's alone), `replica_id` names this one."""

    def __init__(
        self,
        cfg: LogitpoolConfig,
        worker: Any,
        pool: PoolReader,
        peers: PeerReader | None = None,
        replica_id: str = LOCAL_REPLICA,
    ) -> None:
        engine = cfg.engine
        if engine.model is None:
            raise ValueError("engine.model: the front end needs a resolved model (cluster.app.resolve_model)")
        self.cfg = cfg
        self.model_name = cfg.served_name
        self.tokenizer = AutoTokenizer.from_pretrained(engine.model)
        vocab_size, self.max_model_len = model_limits(engine.model, engine.max_model_len)
        self.processors: LogitsProcessors = build_logits_processors(
            engine, torch.device("cpu"), False, custom=engine.logits_processors, entry_points=engine.load_entry_points
        )
        self.validator = RequestValidator(
            self.tokenizer, vocab_size, self.max_model_len, engine.max_logprobs, self.processors
        )
        self.api_keys = ApiKeys(cfg.resolve_api_keys(os.environ))
        self.limits = cfg.limits
        self.metrics = Metrics(
            model_name=self.model_name, max_model_len=self.max_model_len, names=cfg.metrics.names, replica=replica_id
        )
        self._peers = peers
        self.timeout_s = REQUEST_TIMEOUT_S
        # The worker's streaming `generate`, bound once (not per request by a method-name string).
        self._generate = worker.options(method_name="generate", stream=True)
        self._pool = pool
        self._backend = self.tokenizer.backend_tokenizer
        self.max_prompt_chars = prompt_bound.max_prompt_chars(
            prompt_bound.max_chars_per_token(self._backend), self.max_model_len
        )
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="logitpool-tokenize")

    # -- requests in -----------------------------------------------------------------------

    def authorize(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless the credentials are accepted (or auth is off)."""
        self.api_keys.check(authorization)

    def scheduling(self, authorization: str | None, group: str, priority: int = 0) -> Scheduling:
        """Whose a request is, for the workers' fair admission: ``group`` (one per client request)
        under the tenant of its API key, a non-secret id (`tenant_id`); "" when keys are off."""
        if priority != 0 and self.cfg.engine.scheduling_policy == "fcfs":
            raise ValueError(f"priority: got {priority} but engine.scheduling_policy is fcfs (use fair or priority)")
        tenant = tenant_id(authorization) if self.api_keys.enabled else ""
        return Scheduling(group=group, tenant=tenant, priority=priority)

    def check_model(self, model: object) -> None:
        """A request may omit `model`; naming another one is a 404 (vLLM's answer)."""
        if isinstance(model, str) and model != self.model_name:
            raise ModelNotFound(model)

    def check_prompt_chars(self, prompt: str | list[int], field: str = "prompt") -> None:
        """A text prompt that cannot fit the context, refused from its length (cluster.prompt_bound)."""
        bound = self.max_prompt_chars
        if isinstance(prompt, str) and bound is not None and len(prompt) > bound:
            raise ValueError(
                f"{field}: {len(prompt)} characters cannot fit in max_model_len ({self.max_model_len}) "
                f"tokens: at most {bound} can, for this tokenizer"
            )

    def check_request(
        self,
        params: SamplingParams,
        prompts: list[str | list[int]],
        shape: ResponseShape = ONCE,
        tokens: PromptTokens = TEXT_TOKENS,
    ) -> Prepared:
        """Limits, then validate and tokenize, then max_tokens against the context, then the
        response's size; raises ValueError naming the field (both protocols). ``shape``: how the
        protocol's response lays out logprobs; ``tokens``: special tokens and truncation. Returns
        the params to dispatch (max_tokens fitted to the context) and the prompts' ids."""
        check_prompts(prompts)
        request_limits.check_request(self.limits, params, len(prompts))
        keep = tokens.keep(self.max_model_len)
        if keep is None:  # a prompt to be truncated may be longer than the context
            for p in prompts:
                self.check_prompt_chars(p)
        params = self.validator.validate(params)
        ids = [
            self.validator.check_length(tokens.truncate(self.validator.encode(p, tokens.add_special_tokens), keep))
            for p in prompts
        ]
        params = fit_to_context(params, max(map(len, ids)), self.max_model_len)
        request_limits.check_response(self.limits, params, [len(i) for i in ids], self.max_model_len, shape)
        return Prepared(params, ids)

    async def _off_loop(self, grammar: object, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a request's checks and tokenizing) off the event loop unless ``size`` is
        small; one that may wait for a grammar compile (``grammar`` not None; bounded) waits in
        the default executor, not on the tokenizing threads."""
        if grammar is not None:
            return await asyncio.to_thread(fn, *args)
        if size <= INLINE_PROMPT_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def prepare(
        self,
        params: SamplingParams,
        prompts: list[str | list[int]],
        shape: ResponseShape = ONCE,
        tokens: PromptTokens = TEXT_TOKENS,
    ) -> Prepared:
        """check_request, off the event loop when there is much to tokenize or a grammar to compile."""
        size = sum(map(len, prompts))
        return await self._off_loop(params.structured_outputs, size, self.check_request, params, prompts, shape, tokens)

    async def prepare_chat(
        self,
        params: SamplingParams,
        turns: list[Turn],
        how: ChatRender = GENERATION_PROMPT,
        tokens: PromptTokens = CHAT_TOKENS,
        tools: list[dict[str, Any]] | None = None,
    ) -> Prepared:
        """The chat template rendered (with the ``tools`` the model may call, for templates that
        show them) and checked like a prompt (one prompt)."""
        size = sum(len(text) for _, text in turns)
        return await self._off_loop(params.structured_outputs, size, self._chat_ids, params, turns, how, tokens, tools)

    def _chat_ids(
        self,
        params: SamplingParams,
        turns: list[Turn],
        how: ChatRender,
        tokens: PromptTokens,
        tools: list[dict[str, Any]] | None = None,
    ) -> Prepared:
        text = render_chat(self.tokenizer, turns, how, tools)
        if tokens.truncate_prompt_tokens is None:
            self.check_prompt_chars(text, "messages")
        return self.check_request(params, [text], tokens=tokens)

    # -- tokenizer routes (vLLM's /tokenize and /detokenize) -------------------------------

    async def tokenize(
        self,
        prompt: str | list[Turn],
        add_special_tokens: bool,
        how: ChatRender = GENERATION_PROMPT,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """A text prompt's (or a rendered chat's, with its ``tools``) token ids, any length: the
        caller is measuring."""
        size = len(prompt) if isinstance(prompt, str) else sum(len(text) for _, text in prompt)
        return await self._off_loop(None, size, self._tokenize, prompt, add_special_tokens, how, tools)

    def _tokenize(
        self, prompt: str | list[Turn], add_special_tokens: bool, how: ChatRender, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        if isinstance(prompt, str):
            return self.validator.encode(prompt, add_special_tokens)
        text = render_chat(self.tokenizer, prompt, how, tools)
        return self.validator.encode(text, add_special_tokens, "messages")

    async def detokenize(self, ids: list[int]) -> str:
        """Token ids (checked against the vocabulary) as text, special tokens kept (vLLM's)."""
        checked = self.validator.encode(ids, field="tokens")
        return await self._off_loop(None, len(checked), self.tokenizer.decode, checked)

    def token_strs(self, ids: list[int]) -> list[str]:
        """The tokenizer's own piece for each id (``convert_ids_to_tokens``; vLLM's token_strs)."""
        return list(self.tokenizer.convert_ids_to_tokens(ids))

    # -- dispatch and streaming ------------------------------------------------------------

    def decode_token(self, tok: int) -> str:
        """One token's text, special tokens kept (logprobs' `token` fields, both protocols)."""
        return self._backend.decode([tok], skip_special_tokens=False)

    async def stream_deltas(
        self, request_id: str, ids: list[int], params: SamplingParams, scheduling: Scheduling | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs from a worker (`_worker_deltas`), timed for the metrics as they arrive;
        a sequence the engine ended with an error raises RequestFailed."""
        clock = self.metrics.clock(len(ids), params.n)
        try:
            async with contextlib.aclosing(self._worker_deltas(request_id, ids, params, scheduling)) as deltas:
                async for delta in deltas:
                    clock.add(delta)
                    for c in delta.outputs:
                        if c.finish_reason == "error":
                            raise RequestFailed(c.error or "request failed")
                    yield delta
        finally:
            clock.close()

    async def _worker_deltas(
        self, request_id: str, ids: list[int], params: SamplingParams, scheduling: Scheduling | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Delta outputs from a worker; each wait bounded by the request timeout.

        A replica that is gone or whose engine died before sending anything is not the
        request's fault: the call is retried (REPLICA_RETRIES times) on whichever replica
        Serve's router picks, since Serve takes a few health checks to stop routing to it.
        """
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(REPLICA_RETRIES + 1):
            gen = self._generate.remote(request_id, ids, params, scheduling)
            it = gen.__aiter__()
            started = False
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(request_id)
                    try:
                        delta = await asyncio.wait_for(it.__anext__(), remaining)
                    except StopAsyncIteration:
                        return
                    except Exception as exc:
                        if time.monotonic() >= deadline:  # the cancelled call may raise its own error
                            raise TimeoutError(request_id) from exc
                        if started or attempt == REPLICA_RETRIES or not replica_unavailable(exc):
                            raise
                        logger.warning(
                            "request %s (x-request-id %s): worker replica unavailable (%r), retrying",
                            request_id,
                            request_ids.current(),
                            exc,
                        )
                        break
                    started = True
                    yield delta
            finally:
                gen.cancel()
            await asyncio.sleep(REPLICA_RETRY_BACKOFF_S * (attempt + 1))

    async def run(
        self, request_id: str, ids: list[int], params: SamplingParams, scheduling: Scheduling | None = None
    ) -> RequestOutput:
        """The whole output of one request (its deltas accumulated), prompt ids included."""
        acc = OutputAccumulator()
        out: RequestOutput | None = None
        async for delta in self.stream_deltas(request_id, ids, params, scheduling):
            out = acc.add(delta)
        if out is None or not out.finished:
            raise RequestFailed("worker stream ended before the request finished")
        out.prompt_token_ids = ids  # deltas arrive without the prompt
        return out

    # -- accounting and readiness ----------------------------------------------------------

    def count_ok(
        self, protocol: str, outs: list[RequestOutput] | tuple[RequestOutput, ...] = (), tokens: int = 0
    ) -> None:
        self.metrics.request(protocol, 200 if protocol == "http" else "OK", outs, tokens=tokens)

    def count_error(self, status: Status, protocol: str) -> None:
        self.metrics.request(protocol, status.http if protocol == "http" else status.grpc.name)
        if 400 <= status.http < 500:
            self.metrics.reject(protocol, status.http)

    async def metrics_text(self) -> tuple[bytes, str]:
        """/metrics: every ingress replica's request metrics and the worker pool's stats."""
        peers = await self._peers() if self._peers is not None else []
        return self.metrics.render(await self.pool(), peers)

    async def pool(self) -> list[pool_stats.PoolSnapshot]:
        """Fresh engine stats of every worker replica."""
        return await self._pool()

    async def workers_ready(self) -> bool:
        """True while at least one worker replica's engine loop is alive and stepping."""
        return pool_stats.any_alive(await self.pool())


def tenant_id(authorization: str | None) -> str:
    """A non-secret id of an accepted API key: 12 hex digits of its SHA-256 (the same on every
    ingress replica, and it reveals nothing of a key that is not already guessable)."""
    token = bearer_token(authorization) or ""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:12]
