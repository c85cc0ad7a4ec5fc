"""The OpenAI-compatible HTTP side of the front end: bytes in, JSON / server-sent events out.

Holds a `Frontend` and does only what is HTTP's: reading the body within the limits, parsing
it into the protocol's models, and rendering responses, stream chunks and errors (whose JSON is
built in one place, cluster.openai.routes.status_response / error_body). Routes: cluster.openai.routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster import limits as request_limits
from cluster import pool_stats
from cluster.errors import RequestFailed, classify, error_body
from cluster.frontend import Frontend
from cluster.limits import (
    ONCE,
    PayloadTooLarge,
    RequestTimeout,
    ResponseShape,
    UnsupportedMediaType,
    response_logprobs,
)
from cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Echo,
    TokenizeChatRequest,
    ToolDelta,
    after_echo,
    chat_choices,
    chat_chunk,
    chat_head,
    chat_response,
    chat_tail,
    completion_choices,
    completion_chunk,
    completion_head,
    completion_response,
    completion_usage,
    echoed,
    new_id,
    now,
    output_text,
    tokenize_request,
    tokenize_response,
    usage,
    usage_chunk,
)
from cluster.openai.responses import (
    NotStored,
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    finished,
    responses_fields,
    sse_event,
)
from cluster.openai.shapes import CompletionChunk, DetokenizeResponse, ModelCard, ModelList
from cluster.openai.tool_parsers import load_tool_call_parser
from cluster.openai.tools import ToolCalling, ToolCallStream
from cluster.openai.wire import (
    StreamedJSONResponse,
    StrictJSONResponse,
    charset,
    is_json,
    json_chunks,
    sse,
    status_response,
)
from worker.outputs import OutputAccumulator, RequestOutput
from worker.request import Scheduling
from worker.sampling_params import SamplingParams

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest, DetokenizeRequest)
DONE = "data: [DONE]\n\n"
# A response that may carry more logprob entries than this, or more choices, is written in
# pieces as it is encoded (cluster.openai.wire.json_chunks), never held whole next to its objects.
STREAM_ABOVE_LOGPROBS = 1 << 14
STREAM_ABOVE_CHOICES = 64


class HttpAdapter:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        # How tool_choice "auto" reads the model's text (config: tool_call_parser).
        self.tool_parser = load_tool_call_parser(frontend.cfg.tool_call_parser)

    def error(self, exc: BaseException) -> JSONResponse:
        status = classify(exc)
        self.frontend.count_error(status, "http")
        return status_response(status)

    def _error_event(self, exc: BaseException) -> list[str]:
        """A stream that fails mid-way: an error event, then still `[DONE]`."""
        status = classify(exc)
        self.frontend.count_error(status, "http")
        return [sse(error_body(status)), DONE]

    async def _read_body(self, request: Request) -> bytes:
        """The body, bounded in size (limits.max_body_bytes) and in time (limits.read_timeout_s)."""
        limits = self.frontend.limits
        content_type = request.headers.get("content-type")
        if content_type is not None and not is_json(content_type):
            raise UnsupportedMediaType(f"content-type: {content_type[:64]!r} is not supported, send application/json")
        encoding = charset(content_type or "")
        if encoding not in (None, "utf-8", "utf8"):
            raise UnsupportedMediaType(f"content-type: charset {encoding[:32]!r} is not supported, JSON is UTF-8")
        limit = limits.max_body_bytes
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
            await asyncio.wait_for(read(), limits.read_timeout_s)
        except TimeoutError:
            raise RequestTimeout(
                f"body: not received within limits.read_timeout_s ({limits.read_timeout_s}s)"
            ) from None
        return b"".join(chunks)

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        return model.model_validate(await self._parse_json(request))

    async def _parse_json(self, request: Request) -> object:
        """The body as JSON, once the key is accepted, within the limits, `model` checked."""
        self.frontend.authorize(request.headers.get("authorization"))
        body = request_limits.parse_json(self.frontend.limits, await self._read_body(request))
        if isinstance(body, dict):
            self.frontend.check_model(body.get("model"))
        return body

    def _scheduling(self, request: Request, rid: str, body: CompletionRequest | ChatCompletionRequest) -> Scheduling:
        """One group per client request (every prompt of a batch), under its API key's tenant."""
        return self.frontend.scheduling(request.headers.get("authorization"), rid, body.priority)

    def denied(self, request: Request) -> Response | None:
        """The 401 response when the API key is missing or wrong, else None."""
        try:
            self.frontend.authorize(request.headers.get("authorization"))
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        return None

    # -- /v1/completions -------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        fe = self.frontend
        rid = new_id("cmpl")
        try:
            body = await self._parse(request, CompletionRequest)
            raw = body.prompts()
            shape = ResponseShape(prompt_logprobs_per_choice=not body.stream, echo=body.echo)
            ready = await fe.prepare(body.sampling_params(), raw, shape, body.prompt_tokens)
            params, prompts = ready.params, ready.prompts
            sched = self._scheduling(request, rid, body)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        if body.stream:
            return StreamingResponse(
                self._stream_completions(rid, prompts, params, body, raw, sched), media_type="text/event-stream"
            )
        try:
            outs = await asyncio.gather(*(fe.run(f"{rid}-{i}", ids, params, sched) for i, ids in enumerate(prompts)))
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        fe.count_ok("http", outs)
        echoes = [self._echo(r, ids, out, body) for r, ids, out in zip(raw, prompts, outs)] if body.echo else None
        args = (fe.decode_token, bool(body.return_token_ids), body.include_stop_str_in_output, echoes)
        if self._large(params, prompts, shape):
            choices = completion_choices(outs, *args)
            return StreamedJSONResponse(
                json_chunks(
                    completion_head(rid, fe.model_name),
                    "choices",
                    choices,
                    lambda: {"usage": completion_usage(outs, echoes)},
                )
            )
        return StrictJSONResponse(completion_response(rid, fe.model_name, list(outs), *args))

    def _large(self, params: SamplingParams, prompts: list[list[int]], shape: ResponseShape = ONCE) -> bool:
        """Whether a response is written in pieces (STREAM_ABOVE_LOGPROBS / _CHOICES)."""
        return (
            len(prompts) * params.n > STREAM_ABOVE_CHOICES
            or response_logprobs(params, [len(p) for p in prompts], self.frontend.max_model_len, shape)
            > STREAM_ABOVE_LOGPROBS
        )

    def _echo(self, raw: str | list[int], ids: list[int], first: RequestOutput, body: CompletionRequest) -> Echo:
        """What `echo` puts in front of a prompt's choices: the prompt as given (token ids, or a
        prompt cut by truncate_prompt_tokens, decoded), its tokens, and the prompt logprobs
        ``first`` (the request's first output) carries."""
        if isinstance(raw, str) and body.truncate_prompt_tokens is None:
            return Echo(raw, ids, first.prompt_logprobs, body.echo_only)
        return Echo(str(self.frontend.tokenizer.decode(ids)), ids, first.prompt_logprobs, body.echo_only)

    async def _stream_completions(
        self,
        rid: str,
        prompts: list[list[int]],
        params: SamplingParams,
        body: CompletionRequest,
        raw: list[str | list[int]],
        sched: Scheduling | None = None,
    ) -> AsyncIterator[str]:
        fe = self.frontend
        streams = [fe.stream_deltas(f"{rid}-{i}", ids, params, sched) for i, ids in enumerate(prompts)]
        state = _CompletionStream(rid, fe.model_name, fe.decode_token, prompts, params.n, body)
        async with contextlib.aclosing(_merged(streams)) as merged:  # closing it cancels the streams
            async for i, item in merged:
                if isinstance(item, BaseException):
                    for event in self._error_event(item):
                        yield event
                    return
                if body.echo and i not in state.echoes:
                    state.echoes[i] = self._echo(raw[i], prompts[i], item, body)
                for chunk in state.chunks(i, item):
                    yield sse(chunk)
        if body.include_usage:
            u = usage(sum(map(len, prompts)), state.n_tokens, sum(state.cached.values()))
            yield sse(usage_chunk(rid, fe.model_name, "text_completion", u, created=state.created))
        fe.count_ok("http", tokens=state.n_tokens)
        yield DONE

    # -- /v1/chat/completions --------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        fe = self.frontend
        rid = new_id("chatcmpl")
        try:
            body = await self._parse(request, ChatCompletionRequest)
            params, ids, sched, tools = await self._prepare_chat(request, rid, body)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        top_n = body.top_logprobs or 0
        if body.stream:
            return StreamingResponse(
                self._stream_chat(rid, ids, params, top_n, body, tools, sched), media_type="text/event-stream"
            )
        try:
            out = await fe.run(rid, ids, params, sched)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        fe.count_ok("http", [out])
        token_ids = bool(body.return_token_ids)
        args = (fe.decode_token, top_n, token_ids, tools, body.include_stop_str_in_output)
        if self._large(params, [ids]):
            head, choices = chat_head(rid, fe.model_name), chat_choices(out, *args)
            return StreamedJSONResponse(json_chunks(head, "choices", choices, lambda: chat_tail(out, token_ids)))
        return StrictJSONResponse(chat_response(rid, fe.model_name, out, *args))

    async def _prepare_chat(
        self, request: Request, rid: str, body: ChatCompletionRequest
    ) -> tuple[SamplingParams, list[int], Scheduling, ToolCalling | None]:
        """A chat request's sampling params, prompt ids, scheduling and how its output becomes
        tool calls (chat_choices' ``tool``): the one place for both chat and /v1/responses."""
        fe = self.frontend
        tools = body.tool_calling(self.tool_parser, fe.cfg.tool_call_constrained)
        turns = [m.turn(self.tool_parser) for m in body.messages]
        ready = await fe.prepare_chat(body.sampling_params(tools), turns, body.render, body.prompt_tokens, body.tools)
        return ready.params, ready.ids, self._scheduling(request, rid, body), tools

    async def _stream_chat(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        top_n: int,
        body: ChatCompletionRequest,
        tools: ToolCalling | None = None,
        sched: Scheduling | None = None,
    ) -> AsyncIterator[str]:
        fe = self.frontend
        first: set[int] = set()
        streams: dict[int, ToolCallStream] = {}  # per choice, with tools
        n_tokens, created, cached = 0, now(), 0
        try:
            async for delta in fe.stream_deltas(rid, ids, params, sched):
                if delta.num_cached_tokens is not None:
                    cached = delta.num_cached_tokens
                for c in delta.outputs:
                    n_tokens += len(c.token_ids)
                    tool_delta = None
                    if tools is not None:
                        stream = streams.setdefault(c.index, tools.stream())
                        text = output_text(c, body.include_stop_str_in_output)
                        content, calls = stream.feed(text, c.finish_reason is not None)
                        tool_delta = ToolDelta(content, calls, tools.finish_reason(stream.called, c.finish_reason))
                        if c.index in first and not (
                            content or calls or c.finish_reason or c.logprobs or body.return_token_ids
                        ):
                            continue  # held back (a call's marker may be starting) and nothing else to say
                    yield sse(
                        chat_chunk(
                            rid,
                            fe.model_name,
                            c,
                            fe.decode_token,
                            top_n,
                            c.index not in first,
                            bool(body.return_token_ids),
                            created=created,
                            include_stop=body.include_stop_str_in_output,
                            prompt_token_ids=ids,
                            tool_delta=tool_delta,
                        )
                    )
                    first.add(c.index)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            for event in self._error_event(exc):
                yield event
            return
        if body.include_usage:
            u = usage(len(ids), n_tokens, cached)
            yield sse(usage_chunk(rid, fe.model_name, "chat.completion.chunk", u, created=created))
        fe.count_ok("http", tokens=n_tokens)
        yield DONE

    # -- /v1/responses (on the chat path: cluster.openai.responses) -------------------------

    async def responses(self, request: Request) -> Response:
        fe = self.frontend
        try:
            body = ResponsesRequest.model_validate(await self._parse_json(request))
            head = ResponseObject.start(fe.model_name, body)
            with responses_fields():
                chat = body.chat_request()
                params, ids, sched, tools = await self._prepare_chat(request, head.id, chat)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        if body.stream:
            stream = self._stream_response(head, ids, params, tools, body.streams_text, sched)
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            out = await fe.run(head.id, ids, params, sched)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        fe.count_ok("http", [out])
        return StrictJSONResponse(finished(head, self._chat_choice(out, tools), out).model_dump(mode="json"))

    def _chat_choice(self, out: RequestOutput, tools: ToolCalling | None) -> Mapping[str, Any]:
        """Chat's answer for ``out``: its one choice, the tool call parsed as chat parses it."""
        return next(chat_choices(out, self.frontend.decode_token, 0, tool=tools))

    async def _stream_response(
        self,
        head: ResponseObject,
        ids: list[int],
        params: SamplingParams,
        tools: ToolCalling | None,
        live: bool,
        sched: Scheduling,
    ) -> AsyncIterator[str]:
        """OpenAI's event stream; ``live``: text is sent as generated (else at the end, whole)."""
        fe = self.frontend
        events = ResponseEvents(head)
        acc = OutputAccumulator()
        out: RequestOutput | None = None
        for event in events.start() + (events.open_text() if live else []):
            yield sse_event(event)
        try:
            async for delta in fe.stream_deltas(head.id, ids, params, sched):
                out = acc.add(delta)
                for c in delta.outputs if live else ():
                    for event in events.text(c.text):
                        yield sse_event(event)
            if out is None or not out.finished:
                raise RequestFailed("worker stream ended before the request finished")
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            status = classify(exc)
            fe.count_error(status, "http")
            for event in events.failed(status):
                yield sse_event(event)
            return
        out.prompt_token_ids = ids  # deltas arrive without the prompt
        fe.count_ok("http", [out])
        for event in events.finish(finished(head, self._chat_choice(out, tools), out)):
            yield sse_event(event)

    async def retrieve_response(self, request: Request, response_id: str) -> Response:
        """GET/DELETE /v1/responses/{id} (and its sub-paths): nothing is stored, so a 404."""
        try:
            self.frontend.authorize(request.headers.get("authorization"))
            raise NotStored(response_id)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)

    # -- the rest --------------------------------------------------------------------------

    def _model_card(self) -> ModelCard:
        fe = self.frontend
        return {
            "id": fe.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "logitpool",
            "root": fe.model_name,
            "parent": None,
            "max_model_len": fe.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        if denied := self.denied(request):
            return denied
        return JSONResponse(ModelList(object="list", data=[self._model_card()]))

    async def model(self, request: Request, model: str) -> Response:
        """GET /v1/models/{model}: the served model's card; any other id is the 404 that a
        request naming it gets."""
        try:
            self.frontend.authorize(request.headers.get("authorization"))
            self.frontend.check_model(model)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        return JSONResponse(self._model_card())

    # -- /tokenize and /detokenize (vLLM's) -----------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        fe = self.frontend
        try:
            body = tokenize_request(await self._parse_json(request))
            if isinstance(body, TokenizeChatRequest):
                turns = [m.turn(self.tool_parser) for m in body.messages]
                ids = await fe.tokenize(turns, body.add_special_tokens, body.render, body.tools)
            else:
                ids = await fe.tokenize(body.prompt, body.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        strs = fe.token_strs(ids) if body.return_token_strs else None
        return StrictJSONResponse(tokenize_response(ids, fe.max_model_len, strs))

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._parse(request, DetokenizeRequest)
            text = await self.frontend.detokenize(body.tokens)
        except Exception as exc:  # noqa: BLE001 - classify() maps every failure to its HTTP status
            return self.error(exc)
        return StrictJSONResponse(DetokenizeResponse(prompt=text))

    async def list_processors(self, request: Request) -> Response:
        if denied := self.denied(request):
            return denied
        procs = self.frontend.processors
        return JSONResponse(
            {
                "object": "list",
                "data": [p.as_json() for p in procs.describe()],
                "strict_extra_args": procs.strict_extra_args,
            }
        )

    async def health(self) -> Response:
        """200 only while some worker replica's engine loop is alive and stepping (its heartbeat)."""
        pool = await self.frontend.pool()
        alive = pool_stats.num_alive(pool)
        if alive:
            return JSONResponse({"status": "ok", "workers_alive": alive, "workers": len(pool)})
        return JSONResponse({"status": "unavailable", "workers_alive": 0, "workers": len(pool)}, status_code=503)

    async def prometheus(self) -> Response:
        body, content_type = await self.frontend.metrics_text()
        return Response(body, media_type=content_type)


async def _merged(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncGenerator[tuple[int, RequestOutput | BaseException]]:
    """The deltas of several streams as they come, each with its stream's index; a stream's
    failure is yielded (then the merge ends). Every stream is cancelled when the merge is closed."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the client stream
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    done = 0
    try:
        while done < len(tasks):
            i, item = await queue.get()
            if item is None:
                done += 1
                continue
            yield i, item
            if isinstance(item, BaseException):
                return
    finally:
        for t in tasks:
            t.cancel()


class _CompletionStream:
    """One streamed /v1/completions response over its prompts: the chunks of each delta, the
    characters sent per choice (the next text_offset), each prompt's echo and cache hits."""

    def __init__(
        self,
        rid: str,
        model: str,
        decode: Callable[[int], str],
        prompts: list[list[int]],
        n: int,
        body: CompletionRequest,
    ) -> None:
        self.rid, self.model, self.decode, self.prompts, self.n, self.body = rid, model, decode, prompts, n, body
        self.created = now()
        self.n_tokens = 0
        self.sent: dict[int, int] = {}  # characters sent per choice index
        self.echoes: dict[int, Echo] = {}  # per prompt, from its first delta (which carries the prompt logprobs)
        self.cached: dict[int, int] = {}  # per prompt, prompt tokens the prefix cache served

    def chunks(self, i: int, item: RequestOutput) -> Iterator[CompletionChunk]:
        body, token_ids = self.body, bool(self.body.return_token_ids)
        if item.num_cached_tokens is not None:
            self.cached[i] = item.num_cached_tokens
        for choice in item.outputs:
            index = i * self.n + choice.index
            self.n_tokens += 0 if body.echo_only else len(choice.token_ids)
            c = choice
            if body.echo:  # the prompt comes first, in the choice's first chunk (as vLLM)
                echo = self.echoes[i]
                c = after_echo(choice, echo) if index in self.sent else echoed(choice, echo)
                if index in self.sent and not c.text and c.finish_reason is None:
                    continue
            chunk = completion_chunk(
                self.rid,
                self.model,
                c,
                self.decode,
                i * self.n,
                ([] if body.echo_only else choice.token_ids) if token_ids else None,
                created=self.created,
                text_offset=self.sent.get(index, 0),
                include_stop=body.include_stop_str_in_output,
                prompt_token_ids=self.prompts[i] if token_ids and index not in self.sent else None,
            )
            lp = chunk["choices"][0]["logprobs"]
            # Offsets run over the tokens' texts, as in the whole response (an echoed prompt's
            # special tokens are in them, not in its text).
            self.sent[index] = (
                lp["text_offset"][-1] + len(lp["tokens"][-1])
                if lp and lp["tokens"]
                else self.sent.get(index, 0) + len(chunk["choices"][0]["text"])
            )
            yield chunk
