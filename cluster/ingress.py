"""The ingress deployment: OpenAI-compatible HTTP and native gRPC on one Serve deployment.

Every request is converted once to ``worker.SamplingParams``, validated (standard rules and every
loaded processor's ``validate_params``) and tokenized here; a bad request never reaches a
worker. Valid ones stream from a worker replica chosen by Serve's router.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from transformers import AutoTokenizer

from cluster import grpc_service, pool_stats
from cluster import limits as request_limits
from cluster.auth import ApiKeys
from cluster.config import LogitpoolConfig, worker_engine_config
from cluster.errors import ModelNotFound, RequestFailed, Status, classify, error_body, replica_unavailable
from cluster.http_app import StrictJSONResponse, api, is_json, sse, status_response
from cluster.limits import PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from cluster.metrics import Metrics
from cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Echo,
    after_echo,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    echoed,
    fit_to_context,
    new_id,
    now,
    render_chat,
    usage,
    usage_chunk,
)
from cluster.replica_bind import bind_replica_grpc_to_node_ip
from worker.logits_processor.registry import build_logits_processors
from worker.models import model_limits
from worker.outputs import OutputAccumulator, RequestOutput
from worker.sampling_params import SamplingParams
from worker.validation import RequestValidator

logger = logging.getLogger(__name__)

# Upper bound on one request end to end; nothing waits forever.
REQUEST_TIMEOUT_S = 600.0
# Retries of a request whose worker replica was unavailable before it produced anything; the
# backoff adds up to a few seconds, past the time a dead replica takes to leave the routers.
REPLICA_RETRIES = 5
REPLICA_RETRY_BACKOFF_S = 0.2


class LogitpoolIngress(grpc_service.GrpcMethods):
    def __init__(self, worker: DeploymentHandle, config: dict[str, Any]) -> None:
        bind_replica_grpc_to_node_ip()
        self.cfg = LogitpoolConfig.model_validate(config)
        engine = worker_engine_config(self.cfg)
        self.model_name = self.cfg.served_name
        self.tokenizer = AutoTokenizer.from_pretrained(engine.model)
        vocab_size, max_model_len = model_limits(engine.model, engine.max_model_len)
        self.processors = build_logits_processors(
            engine, torch.device("cpu"), False, custom=engine.logits_processors, entry_points=engine.load_entry_points
        )
        self.validator = RequestValidator(self.tokenizer, vocab_size, max_model_len, engine.max_logprobs, self.processors)
        self.max_model_len = max_model_len
        self.api_keys = ApiKeys(self.cfg.resolve_api_keys(os.environ))
        self.worker = worker
        self.timeout_s = REQUEST_TIMEOUT_S
        self.metrics = Metrics()
        self.limits = self.cfg.limits
        self.app_name = serve.get_replica_context().app_name
        self._backend = self.tokenizer.backend_tokenizer

    # -- shared by HTTP and gRPC -----------------------------------------------------------

    def decode_token(self, tok: int) -> str:
        return self._backend.decode([tok], skip_special_tokens=False)

    def check_request(self, params: SamplingParams, prompts: list[str | list[int]]) -> list[list[int]]:
        """Limits, then validate and tokenize; raises ValueError naming the field (both protocols)."""
        request_limits.check_request(self.limits, params, len(prompts))
        self.validator.validate(params)
        return [self.validator.tokenize(p) for p in prompts]

    async def check_request_async(self, params: SamplingParams, prompts: list[str | list[int]]) -> list[list[int]]:
        """check_request, in a thread when a grammar may need compiling (time-bounded, not instant)."""
        if params.structured_outputs is None:
            return self.check_request(params, prompts)
        return await asyncio.to_thread(self.check_request, params, prompts)

    async def stream_deltas(self, request_id: str, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Delta outputs from a worker; each wait bounded by the request timeout.

        A replica that is gone or whose engine died before sending anything is not the
        request's fault: the call is retried (REPLICA_RETRIES times) on whichever replica
        Serve's router picks, since Serve takes a few health checks to stop routing to it.
        """
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(REPLICA_RETRIES + 1):
            gen = self.worker.options(method_name="generate", stream=True).remote(request_id, ids, params)
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
                        if started or attempt == REPLICA_RETRIES or not replica_unavailable(exc):
                            raise
                        logger.warning("request %s: worker replica unavailable (%r), retrying", request_id, exc)
                        break
                    started = True
                    for c in delta.outputs:
                        if c.finish_reason == "error":
                            raise RequestFailed(c.error or "request failed")
                    yield delta
            finally:
                gen.cancel()
            await asyncio.sleep(REPLICA_RETRY_BACKOFF_S * (attempt + 1))

    async def run(self, request_id: str, ids: list[int], params: SamplingParams) -> RequestOutput:
        acc = OutputAccumulator()
        out: RequestOutput | None = None
        async for delta in self.stream_deltas(request_id, ids, params):
            out = acc.add(delta)
        if out is None or not out.finished:
            raise RequestFailed("worker stream ended before the request finished")
        out.prompt_token_ids = ids  # deltas arrive without the prompt
        return out

    async def workers_ready(self) -> bool:
        """True while at least one worker replica's engine loop is alive and stepping."""
        return pool_stats.any_alive(await pool_stats.collect(self.app_name))

    # -- HTTP ------------------------------------------------------------------------------

    def _count_error(self, status: Status, protocol: str) -> None:
        self.metrics.request(protocol, status.http if protocol == "http" else status.grpc.name)
        if 400 <= status.http < 500:
            self.metrics.reject(protocol, status.http)

    def _error(self, exc: BaseException, protocol: str = "http") -> JSONResponse:
        status = classify(exc)
        self._count_error(status, protocol)
        return status_response(status)

    async def _read_body(self, request: Request) -> bytes:
        """The body, bounded in size (limits.max_body_bytes) and in time (limits.read_timeout_s)."""
        content_type = request.headers.get("content-type")
        if content_type is not None and not is_json(content_type):
            raise UnsupportedMediaType(f"content-type: {content_type[:64]!r} is not supported, send application/json")
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"body: {declared} bytes exceeds limits.max_body_bytes ({limit})")
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"body: more than limits.max_body_bytes ({limit}) bytes")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.limits.read_timeout_s)
        except TimeoutError:
            raise RequestTimeout(f"body: not received within limits.read_timeout_s ({self.limits.read_timeout_s}s)") from None
        return b"".join(chunks)

    async def _parse(self, request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest]) -> Any:
        self.api_keys.check(request.headers.get("authorization"))
        body = request_limits.parse_json(self.limits, await self._read_body(request))
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] != self.model_name:
            raise ModelNotFound(str(body["model"]))
        return model.model_validate(body)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        try:
            body: CompletionRequest = await self._parse(request, CompletionRequest)
            params = body.sampling_params()
            raw = body.prompts()
            prompts = await self.check_request_async(params, raw)
        except Exception as exc:
            return self._error(exc)
        rid = new_id("cmpl")
        model = self.model_name
        if body.stream:
            return StreamingResponse(self._stream_completions(rid, model, prompts, params, body, raw),
                                     media_type="text/event-stream")
        try:
            outs = await asyncio.gather(*(self.run(f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)))
        except Exception as exc:
            return self._error(exc)
        self.metrics.request("http", 200, outs)
        echoes = [self._echo(r, ids, out, body) for r, ids, out in zip(raw, prompts, outs)] if body.echo else None
        return StrictJSONResponse(completion_response(rid, model, list(outs), self.decode_token, body.return_token_ids,
                                                      body.include_stop_str_in_output, echoes))

    def _echo(self, raw: str | list[int], ids: list[int], first: RequestOutput, body: CompletionRequest) -> Echo:
        """What `echo` puts in front of a prompt's choices: the prompt as given (token ids decoded),
        its tokens, and the prompt logprobs ``first`` (the request's first output) carries."""
        text = raw if isinstance(raw, str) else self.tokenizer.decode(raw)
        return Echo(text, ids, first.prompt_logprobs, body.echo_only)

    async def _stream_completions(
        self, rid: str, model: str, prompts: list[list[int]], params: SamplingParams, body: CompletionRequest,
        raw: list[str | list[int]],
    ) -> AsyncIterator[str]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for delta in self.stream_deltas(f"{rid}-{i}", ids, params):
                    await queue.put((i, delta))
                await queue.put((i, None))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the client stream
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        done, n_tokens, created = 0, 0, now()
        sent: dict[int, int] = {}  # characters sent per choice index: the next text_offset
        echoes: dict[int, Echo] = {}  # per prompt, from its first delta (which carries the prompt logprobs)
        try:
            while done < len(tasks):
                i, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    status = classify(item)
                    self._count_error(status, "http")
                    yield sse(error_body(status))
                    yield "data: [DONE]\n\n"
                    return
                if body.echo and i not in echoes:
                    echoes[i] = self._echo(raw[i], prompts[i], item, body)
                for c in item.outputs:
                    index = i * params.n + c.index
                    n_tokens += 0 if body.echo_only else len(c.token_ids)
                    if body.echo:  # the prompt comes first, in the choice's first chunk (as vLLM)
                        c = after_echo(c, echoes[i]) if index in sent else echoed(c, echoes[i])
                        if index in sent and not c.text and c.finish_reason is None:
                            continue
                    chunk = completion_chunk(rid, model, c, self.decode_token, i * params.n, body.return_token_ids,
                                             created=created, text_offset=sent.get(index, 0),
                                             include_stop=body.include_stop_str_in_output)
                    lp = chunk["choices"][0]["logprobs"]
                    # Offsets run over the tokens' texts, as in the whole response (an echoed
                    # prompt's special tokens are in them, not in its text).
                    sent[index] = (lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp and lp["tokens"]
                                   else sent.get(index, 0) + len(chunk["choices"][0]["text"]))
                    yield sse(chunk)
            if body.include_usage:
                yield sse(usage_chunk(rid, model, "text_completion", usage(sum(map(len, prompts)), n_tokens),
                                      created=created))
            self.metrics.request("http", 200, tokens=n_tokens)
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
            params = body.sampling_params()
            prompt = render_chat(self.tokenizer, body.messages)
            (ids,) = await self.check_request_async(params, [prompt])
            fit_to_context(params, len(ids), self.max_model_len)
        except Exception as exc:
            return self._error(exc)
        rid = new_id("chatcmpl")
        model = self.model_name
        top_n = body.top_logprobs or 0
        if body.stream:
            return StreamingResponse(self._stream_chat(rid, model, ids, params, top_n, body),
                                     media_type="text/event-stream")
        try:
            out = await self.run(rid, ids, params)
        except Exception as exc:
            return self._error(exc)
        self.metrics.request("http", 200, [out])
        return StrictJSONResponse(chat_response(rid, model, out, self.decode_token, top_n, body.return_token_ids,
                                                body.forced_tool, body.include_stop_str_in_output))

    async def _stream_chat(
        self, rid: str, model: str, ids: list[int], params: SamplingParams, top_n: int, body: ChatCompletionRequest
    ) -> AsyncIterator[str]:
        first: set[int] = set()
        n_tokens, created = 0, now()
        try:
            async for delta in self.stream_deltas(rid, ids, params):
                for c in delta.outputs:
                    n_tokens += len(c.token_ids)
                    yield sse(chat_chunk(rid, model, c, self.decode_token, top_n, c.index not in first,
                                          body.return_token_ids, created=created,
                                          include_stop=body.include_stop_str_in_output))
                    first.add(c.index)
        except Exception as exc:
            status = classify(exc)
            self._count_error(status, "http")
            yield sse(error_body(status))
            yield "data: [DONE]\n\n"
            return
        if body.include_usage:
            yield sse(usage_chunk(rid, model, "chat.completion.chunk", usage(len(ids), n_tokens), created=created))
        self.metrics.request("http", 200, tokens=n_tokens)
        yield "data: [DONE]\n\n"

    def _denied(self, request: Request) -> Response | None:
        """The 401 response when the API key is missing or wrong, else None."""
        try:
            self.api_keys.check(request.headers.get("authorization"))
        except Exception as exc:
            return self._error(exc)
        return None

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "logitpool", "root": self.model_name,
             "parent": None, "max_model_len": self.max_model_len}
        ]})

    @api.get("/v1/processors")
    async def list_processors(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        return JSONResponse(
            {"object": "list", "data": self.processors.describe(), "strict_extra_args": self.processors.strict_extra_args}
        )

    @api.get("/health")
    async def health(self) -> Response:
        """200 only while some worker replica's engine loop is alive and stepping (its heartbeat)."""
        pool = await pool_stats.collect(self.app_name)
        alive = sum(1 for s in pool if s.get("alive"))
        if alive:
            return JSONResponse({"status": "ok", "workers_alive": alive, "workers": len(pool)})
        return JSONResponse({"status": "unavailable", "workers_alive": 0, "workers": len(pool)}, status_code=503)

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        body, content_type = self.metrics.render(await pool_stats.collect(self.app_name))
        return Response(body, media_type=content_type)


IngressDeployment = serve.deployment(name="LogitpoolIngress")(serve.ingress(api)(LogitpoolIngress))
