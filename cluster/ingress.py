"""The ingress deployment: OpenAI-compatible HTTP and native gRPC on one Serve deployment.

Every request is converted once to ``worker.SamplingParams``, validated (standard rules and every
loaded processor's ``validate_params``) and tokenized here; a bad request never reaches a
worker. Valid ones stream from a worker replica chosen by Serve's router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from transformers import AutoTokenizer

from cluster import grpc_service
from cluster.auth import ApiKeys
from cluster.config import LogitpoolConfig, worker_engine_config
from cluster.errors import RequestFailed, classify
from cluster.metrics import Metrics
from cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    render_chat,
    usage,
    usage_chunk,
)
from worker.logits_processor.registry import build_logits_processors
from worker.models import model_limits
from worker.outputs import OutputAccumulator, RequestOutput
from worker.sampling_params import SamplingParams
from worker.validation import RequestValidator

logger = logging.getLogger(__name__)

# Upper bound on one request end to end; nothing waits forever.
REQUEST_TIMEOUT_S = 600.0

api = FastAPI(title="logitpool", description="OpenAI-compatible completions over a logitpool worker pool")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class LogitpoolIngress(grpc_service.GrpcMethods):
    def __init__(self, worker: DeploymentHandle, config: dict[str, Any]) -> None:
        self.cfg = LogitpoolConfig.model_validate(config)
        engine = worker_engine_config(self.cfg)
        self.model_name = engine.model or "logitpool-tiny"
        self.tokenizer = AutoTokenizer.from_pretrained(engine.model)
        vocab_size, max_model_len = model_limits(engine.model, engine.max_model_len)
        self.processors = build_logits_processors(
            engine, torch.device("cpu"), False, custom=engine.logits_processors, entry_points=engine.load_entry_points
        )
        self.validator = RequestValidator(self.tokenizer, vocab_size, max_model_len, engine.max_logprobs, self.processors)
        self.api_keys = ApiKeys(self.cfg.resolve_api_keys(os.environ))
        self.worker = worker
        self.timeout_s = REQUEST_TIMEOUT_S
        self.metrics = Metrics()
        self._backend = self.tokenizer.backend_tokenizer

    # -- shared by HTTP and gRPC -----------------------------------------------------------

    def decode_token(self, tok: int) -> str:
        return self._backend.decode([tok], skip_special_tokens=False)

    def check_request(self, params: SamplingParams, prompts: list[str | list[int]]) -> list[list[int]]:
        """Validate and tokenize; raises ValueError naming the field."""
        self.validator.validate(params)
        return [self.validator.tokenize(p) for p in prompts]

    async def check_request_async(self, params: SamplingParams, prompts: list[str | list[int]]) -> list[list[int]]:
        """check_request, in a thread when a grammar may need compiling (time-bounded, not instant)."""
        if params.structured_outputs is None:
            return self.check_request(params, prompts)
        return await asyncio.to_thread(self.check_request, params, prompts)

    async def stream_deltas(self, request_id: str, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Delta outputs from a worker; each wait bounded by the request timeout."""
        gen = self.worker.options(method_name="generate", stream=True).remote(request_id, ids, params)
        deadline = time.monotonic() + self.timeout_s
        it = gen.__aiter__()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(request_id)
                try:
                    delta = await asyncio.wait_for(it.__anext__(), remaining)
                except StopAsyncIteration:
                    return
                for c in delta.outputs:
                    if c.finish_reason == "error":
                        raise RequestFailed(c.error or "request failed")
                yield delta
        finally:
            gen.cancel()

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
        try:
            await asyncio.wait_for(self.worker.info.remote(), 5.0)
            return True
        except Exception:
            return False

    # -- HTTP ------------------------------------------------------------------------------

    def _error(self, exc: BaseException, protocol: str = "http") -> JSONResponse:
        status = classify(exc)
        self.metrics.request(protocol, status.http)
        return JSONResponse(
            {"error": {"message": status.message, "type": status.kind, "code": status.http}}, status_code=status.http
        )

    async def _parse(self, request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest]) -> Any:
        self.api_keys.check(request.headers.get("authorization"))
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise ValueError(f"body: invalid JSON ({exc.msg})") from exc
        return model.model_validate(body)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        try:
            body: CompletionRequest = await self._parse(request, CompletionRequest)
            params = body.sampling_params()
            prompts = await self.check_request_async(params, body.prompts())
        except Exception as exc:
            return self._error(exc)
        rid = new_id("cmpl")
        model = body.model or self.model_name
        if body.stream:
            return StreamingResponse(self._stream_completions(rid, model, prompts, params, body),
                                     media_type="text/event-stream")
        try:
            outs = await asyncio.gather(*(self.run(f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)))
        except Exception as exc:
            return self._error(exc)
        self.metrics.request("http", 200, outs)
        return JSONResponse(completion_response(rid, model, list(outs), self.decode_token, body.return_token_ids))

    async def _stream_completions(
        self, rid: str, model: str, prompts: list[list[int]], params: SamplingParams, body: CompletionRequest
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
        done, n_tokens = 0, 0
        try:
            while done < len(tasks):
                i, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    status = classify(item)
                    self.metrics.request("http", status.http)
                    yield _sse({"error": {"message": status.message, "type": status.kind, "code": status.http}})
                    return
                for c in item.outputs:
                    n_tokens += len(c.token_ids)
                    yield _sse(completion_chunk(rid, model, c, self.decode_token, i * params.n, body.return_token_ids))
            if body.include_usage:
                yield _sse(usage_chunk(rid, model, "text_completion", usage(sum(map(len, prompts)), n_tokens)))
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
        except Exception as exc:
            return self._error(exc)
        rid = new_id("chatcmpl")
        model = body.model or self.model_name
        top_n = body.top_logprobs or 0
        if body.stream:
            return StreamingResponse(self._stream_chat(rid, model, ids, params, top_n, body),
                                     media_type="text/event-stream")
        try:
            out = await self.run(rid, ids, params)
        except Exception as exc:
            return self._error(exc)
        self.metrics.request("http", 200, [out])
        return JSONResponse(chat_response(rid, model, out, self.decode_token, top_n, body.return_token_ids,
                                          body.forced_tool))

    async def _stream_chat(
        self, rid: str, model: str, ids: list[int], params: SamplingParams, top_n: int, body: ChatCompletionRequest
    ) -> AsyncIterator[str]:
        first: set[int] = set()
        n_tokens = 0
        try:
            async for delta in self.stream_deltas(rid, ids, params):
                for c in delta.outputs:
                    n_tokens += len(c.token_ids)
                    yield _sse(chat_chunk(rid, model, c, self.decode_token, top_n, c.index not in first,
                                          body.return_token_ids))
                    first.add(c.index)
        except Exception as exc:
            status = classify(exc)
            self.metrics.request("http", status.http)
            yield _sse({"error": {"message": status.message, "type": status.kind, "code": status.http}})
            return
        if body.include_usage:
            yield _sse(usage_chunk(rid, model, "chat.completion.chunk", usage(len(ids), n_tokens)))
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
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "logitpool"}
        ]})

    @api.get("/v1/processors")
    async def list_processors(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        return JSONResponse({"object": "list", "data": self.processors.describe()})

    @api.get("/health")
    async def health(self) -> Response:
        if await self.workers_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "starting"}, status_code=503)

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


IngressDeployment = serve.deployment(name="LogitpoolIngress")(serve.ingress(api)(LogitpoolIngress))
