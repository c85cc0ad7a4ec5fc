"""The Responses API (``POST /v1/responses``, the OpenAI SDK's ``client.responses.create``) as a
thin mapping onto chat completions, so that prompts, sampling, structured outputs and tool calls
follow chat's rules, each kept in one place.

In: a request becomes a ``ChatCompletionRequest`` (``ResponsesRequest.chat_request``): message
items become messages, ``instructions`` a leading system message, ``text.format`` becomes
``response_format``, function tools and ``tool_choice`` become chat's, and ``max_output_tokens``
becomes ``max_completion_tokens``. Chat's errors are reworded to name the Responses field they
came from (``responses_fields``). Out: chat's answer (its assistant message) becomes output
items (``finished``), and a stream becomes OpenAI's typed event sequence (``ResponseEvents``).

Nothing is stored. Fields that ask for stored state or for features this server lacks
(``previous_response_id``, ``store: true``, ``background``, built-in tools, ``reasoning``, ...)
are a 400 naming the field (cluster.openai.unimplemented.RESPONSES), never silently ignored.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.errors import Status, classify, error_param
from cluster.openai import unimplemented
from cluster.openai.protocol import ChatCompletionRequest, _Refusing, cached_tokens, now
from cluster.openai.wire import dumps
from worker.outputs import RequestOutput

# -- the request -------------------------------------------------------------------------------

# Chat roles for the Responses roles: "developer" instructions are the system turn (what OpenAI
# means by them for models that have no separate developer role, as the chat templates here).
CHAT_ROLES: Mapping[str, str] = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Content parts that are text (input text, and an earlier answer's output text sent back).
TEXT_PARTS = ("input_text", "output_text")


class _Loose(BaseModel):
    """A part of the request: unknown fields ignored (newer SDKs add fields)."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(_Loose):
    type: str
    text: str | None = None


class InputItem(_Loose):
    """One item of ``input``: a message (OpenAI's EasyInputMessage, input message, or an
    earlier output message sent back), or the agent loop's items: an earlier ``function_call``
    the model made (``call_id``, ``name``, ``arguments``) and its ``function_call_output``
    (``call_id``, ``output``). Other item types are a 400 (``ResponsesRequest.chat_messages``)."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None

    def chat_message(self, where: str) -> dict[str, str]:
        if self.type != "message":
            raise ValueError(
                f"{where}.type: {self.type!r} items are not supported "
                "(message, function_call and function_call_output items only)"
            )
        role = CHAT_ROLES.get(self.role or "")
        if role is None:
            raise ValueError(f"{where}.role: must be one of {', '.join(CHAT_ROLES)}, got {self.role!r}")
        if self.content is None:
            raise ValueError(f"{where}.content: required")
        return {"role": role, "content": _text(self.content, f"{where}.content")}

    def chat_tool_call(self, where: str) -> dict[str, Any]:
        """A ``function_call`` item as chat's tool call of an assistant message."""
        for key in ("call_id", "name", "arguments"):
            if getattr(self, key) is None:
                raise ValueError(f"{where}.{key}: required for a function_call item")
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def chat_tool_message(self, where: str, calls: set[str]) -> dict[str, str]:
        """A ``function_call_output`` item as chat's ``tool`` message answering ``call_id``,
        which an earlier function_call item (of ``calls``) must have made (as OpenAI checks)."""
        if self.call_id is None:
            raise ValueError(f"{where}.call_id: required for a function_call_output item")
        if self.call_id not in calls:
            raise ValueError(f"{where}.call_id: no earlier function_call item has call_id {self.call_id[:100]!r}")
        if self.output is None:
            raise ValueError(f"{where}.output: required for a function_call_output item")
        return {"role": "tool", "tool_call_id": self.call_id, "content": _text(self.output, f"{where}.output")}


def _text(content: str | list[ContentPart], where: str) -> str:
    """A content's text: a string, or text parts joined (other parts are a 400)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise ValueError(f"{where}[{j}].type: {part.type!r} is not supported (text parts only)")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """``input`` items as chat messages: function_call items are the ``tool_calls`` of the
    assistant message they follow (one message per answer, as chat sends an answer with its
    text and parallel calls back), each function_call_output a
    ``tool`` message, so the chat template renders them in the tool-call parser's format."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "function_call":
            call = item.chat_tool_call(where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the answer's text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append(item.chat_tool_message(where, calls))
        else:
            messages.append(item.chat_message(where))
    return messages


class TextFormat(_Loose):
    """``text.format``: OpenAI's flat json_schema config (name and schema at its top)."""

    type: str = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        """Chat's ``response_format`` for this format (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type != "json_schema":
            raise ValueError(f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {self.type!r}")
        if not self.name:
            raise ValueError("text.format.name: required for type 'json_schema'")
        if self.schema_ is None:
            raise ValueError("text.format.schema: required for type 'json_schema'")
        spec: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        for key in ("description", "strict"):
            if getattr(self, key) is not None:
                spec[key] = getattr(self, key)
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(_Loose):
    format: TextFormat | None = None


class FunctionTool(_Loose):
    """A tool of ``tools``: OpenAI's flat function tool (name and parameters at its top)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self, where: str) -> dict[str, Any]:
        if self.type != "function":
            raise ValueError(f"{where}.type: {self.type!r} tools are not implemented (function tools only)")
        function: dict[str, Any] = {"name": self.name}
        for key in ("description", "parameters", "strict"):
            if getattr(self, key) is not None:
                function[key] = getattr(self, key)
        return {"type": "function", "function": function}


class ToolChoiceObject(_Loose):
    type: str
    name: str | None = None

    def chat_tool_choice(self) -> dict[str, Any]:
        if self.type != "function":
            raise ValueError(f"tool_choice.type: {self.type!r} is not implemented (a function, by name)")
        return {"type": "function", "function": {"name": self.name}}


class StreamOptions(_Loose):
    """Nothing to set: its one field (``include_obfuscation``) is refused when on."""


class ResponsesRequest(_Refusing):
    """The body of ``POST /v1/responses`` (OpenAI's ResponseCreateParams, the fields served)."""

    unimplemented_fields = unimplemented.RESPONSES

    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None  # one call is always a valid answer
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None  # echoed back, as OpenAI does
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`: an id, echoed
    # vLLM's extension (as chat's): lower is admitted sooner.
    priority: int = 0

    @model_validator(mode="before")
    @classmethod
    def _nested_not_implemented(cls, body: Any) -> Any:
        if isinstance(body, dict):
            unimplemented.reject(body.get("text"), unimplemented.RESPONSES_TEXT, "text.")
            unimplemented.reject(body.get("stream_options"), unimplemented.RESPONSES_STREAM_OPTIONS, "stream_options.")
        return body

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # `stream` is validated first
            raise ValueError("stream_options: only allowed when stream is true")
        return value

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        if not self.input:
            raise ValueError("input: must not be empty")
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        return [*messages, *chat_messages(self.input)]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, ToolChoiceObject):
            return self.tool_choice.chat_tool_choice()
        return self.tool_choice

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one is: everything past here is chat's (call it inside
        ``responses_fields`` so that chat's errors name this request's fields)."""
        fmt = self.text.format if self.text is not None else None
        fields: dict[str, Any] = {
            "messages": self.chat_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "response_format": fmt.response_format() if fmt is not None else None,
            "tools": None if self.tools is None else [t.chat_tool(f"tools[{i}]") for i, t in enumerate(self.tools)],
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
            "priority": self.priority,
        }
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})

    @property
    def streams_text(self) -> bool:
        """Whether text can be sent as it is generated: no tool can be called (a tool call is
        known once the whole output is, as chat parses it)."""
        return not self.tools or self.tool_choice == "none"


# Chat's field -> the Responses field it came from, for error messages (first match wins).
CHAT_FIELDS: tuple[tuple[str, str], ...] = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),  # fit_to_context names max_tokens
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
)
# tools[i].function.x (and a compiled schema's source, tools[name].function.parameters) -> tools[i].x
_CHAT_TOOL = re.compile(r"^(tools\[[^\]]*\])\.function(?=$|[.\[])")


def responses_field(message: str) -> str:
    """``message`` with the chat field it starts with (``"field: ..."``) renamed to ours."""
    head, sep, rest = message.partition(": ")
    if not sep:
        return message
    head = _CHAT_TOOL.sub(r"\1", head)
    for chat, ours in CHAT_FIELDS:
        if head == chat or head.startswith((chat + ".", chat + "[")):
            head = ours + head[len(chat) :]
            break
    return f"{head}: {rest}"


@contextmanager
def responses_fields() -> Iterator[None]:
    """Chat's ValueErrors re-raised naming the Responses fields (same type, same HTTP status)."""
    try:
        yield
    except ValidationError as exc:
        raise ValueError(responses_field(classify(exc).message)) from None
    except ValueError as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (responses_field(exc.args[0]),)
        raise


class NotStored(ValueError):
    """A stored response was asked for: there are none (OpenAI's answer for an unknown id)."""

    http_status = 404

    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"response_id: response {response_id[:100]!r} not found: this server stores no responses "
            "(send the whole conversation as input)"
        )


# -- the response ------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """OpenAI's id style (``resp_...``, ``msg_...``, ``fc_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    cache_write_tokens: int = 0  # OpenAI's explicit cache writes: none here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, out: RequestOutput) -> Usage:
        n_in, n_out = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        return cls(
            input_tokens=n_in,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens([out])),
            output_tokens=n_out,
            total_tokens=n_in + n_out,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """A failed response's error: ``code`` is one of OpenAI's (server_error unless the request
    was at fault), ``type`` this server's kind (cluster.errors.classify)."""

    code: Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]
    message: str
    type: str
    param: str | None = None

    @classmethod
    def of(cls, status: Status) -> ResponseError:
        code: Literal["server_error", "rate_limit_exceeded", "invalid_prompt"] = (
            "server_error" if status.http >= 500 else "rate_limit_exceeded" if status.http == 429 else "invalid_prompt"
        )
        return cls(code=code, message=status.message, type=status.kind, param=error_param(status.message))


class ResponseObject(BaseModel):
    """OpenAI's Response object; the request's settings echoed, as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Usage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    store: bool = False
    background: bool = False
    previous_response_id: None = None

    @classmethod
    def start(cls, model: str, req: ResponsesRequest) -> ResponseObject:
        """The response as it begins (in progress, no output yet)."""
        fmt = req.text.format if req.text is not None else None
        echo: dict[str, Any] = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "metadata": req.metadata or {},
            "user": req.user,
            "safety_identifier": req.safety_identifier,
        }
        if req.tool_choice is not None:
            echo["tool_choice"] = (
                req.tool_choice.model_dump(exclude_none=True)
                if isinstance(req.tool_choice, ToolChoiceObject)
                else req.tool_choice
            )
        if fmt is not None:
            echo["text"] = {"format": fmt.model_dump(by_alias=True, exclude_none=True)}
        return cls(id=new_id("resp"), created_at=now(), status="in_progress", model=model, **echo)


class _ChatFunction(BaseModel):
    name: str
    arguments: str


class _ChatToolCall(BaseModel):
    id: str
    function: _ChatFunction


class ChatAnswer(BaseModel):
    """Chat's assistant message (cluster.openai.protocol's choice `message`): what the output
    items are made of, whatever chat decided (text, tool calls or both)."""

    model_config = ConfigDict(extra="ignore")

    content: str | None = None
    tool_calls: list[_ChatToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    """Chat's one choice, as cluster.openai.protocol.chat_choices builds it."""

    model_config = ConfigDict(extra="ignore")

    message: ChatAnswer
    finish_reason: str | None


def output_items(answer: ChatAnswer, status: ItemStatus) -> list[OutputItem]:
    """The output items of chat's answer: its text as a message (when there is text, or nothing
    else), then one function_call per tool call."""
    items: list[OutputItem] = []
    if answer.content is not None or not answer.tool_calls:
        items.append(OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text=answer.content or "")]))
    items.extend(
        FunctionCall(
            id=new_id("fc"), call_id=c.id, name=c.function.name, arguments=c.function.arguments, status="completed"
        )
        for c in answer.tool_calls
    )
    return items


def finished(head: ResponseObject, chat_choice: Mapping[str, Any], out: RequestOutput) -> ResponseObject:
    """The whole response from chat's one choice: cut by the token limit (``length``) it is
    ``incomplete``, reason max_output_tokens, as OpenAI's."""
    choice = ChatChoice.model_validate(chat_choice)
    cut = choice.finish_reason == "length"
    items = output_items(choice.message, "incomplete" if cut else "completed")
    return head.model_copy(
        update={
            "status": "incomplete" if cut else "completed",
            "output": items,
            "usage": Usage.of(out),
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
        }
    )


# -- the stream --------------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int


LifecycleKind = Literal[
    "response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"
]


class LifecycleEvent(_Event):
    type: LifecycleKind
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(_Event):
    item_id: str
    output_index: int


class ContentPartEvent(_ItemEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    content_index: int
    part: OutputText


class _TextEvent(_ItemEvent):
    content_index: int
    logprobs: list[dict[str, Any]] = Field(default_factory=list)  # never asked for (top_logprobs is refused)


class TextDeltaEvent(_TextEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str


class TextDoneEvent(_TextEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str


class ArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None


Event = (
    LifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)


class ResponseEvents:
    """One response's stream as OpenAI sends it, numbered from 0: created, in_progress, per
    output item (added, its content or arguments, done), then completed / incomplete (or an
    error and failed). Text the caller streams live (``open_text``, ``text``) is the first
    item; the rest come whole at ``finish``. Pure: the caller writes the events."""

    def __init__(self, head: ResponseObject) -> None:
        self.head = head
        self._seq = 0
        self._live: OutputMessage | None = None  # the message being streamed, still empty

    def _n(self) -> int:
        self._seq += 1
        return self._seq - 1

    def start(self) -> list[Event]:
        return [
            LifecycleEvent(type="response.created", sequence_number=self._n(), response=self.head),
            LifecycleEvent(type="response.in_progress", sequence_number=self._n(), response=self.head),
        ]

    def open_text(self) -> list[Event]:
        """The first output item, a message whose text follows (``text``) as it is generated."""
        self._live = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        return self._opened(0, self._live)

    def text(self, delta: str) -> list[Event]:
        if self._live is None or not delta:
            return []
        return [self._delta(0, self._live.id, delta)]

    def finish(self, response: ResponseObject) -> list[Event]:
        """The rest of the stream, ``response`` being the finished one (``finished``)."""
        events: list[Event] = []
        output = list(response.output)
        if self._live is not None:  # the first item is the message already opened
            output[0] = output[0].model_copy(update={"id": self._live.id})
        for index, item in enumerate(output):
            if index > 0 or self._live is None:
                events += self._opened(index, item.model_copy(update={"status": "in_progress"}))
                events += self._body(index, item)
            events += self._closed(index, item)
        response = response.model_copy(update={"output": output})
        kind: LifecycleKind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        events.append(LifecycleEvent(type=kind, sequence_number=self._n(), response=response))
        return events

    def failed(self, status: Status) -> list[Event]:
        """A stream that fails mid-way: OpenAI's error event, then the response failed."""
        error = ResponseError.of(status)
        failed = self.head.model_copy(update={"status": "failed", "error": error})
        return [
            ErrorEvent(sequence_number=self._n(), code=status.kind, message=error.message, param=error.param),
            LifecycleEvent(type="response.failed", sequence_number=self._n(), response=failed),
        ]

    def _opened(self, index: int, item: OutputMessage | FunctionCall) -> list[Event]:
        if isinstance(item, OutputMessage):
            item = item.model_copy(update={"content": []})
        elif isinstance(item, FunctionCall):
            item = item.model_copy(update={"arguments": ""})
        events: list[Event] = [
            OutputItemEvent(type="response.output_item.added", sequence_number=self._n(), output_index=index, item=item)
        ]
        if isinstance(item, OutputMessage):
            events.append(self._part("response.content_part.added", index, item.id, OutputText(text="")))
        return events

    def _body(self, index: int, item: OutputMessage | FunctionCall) -> list[Event]:
        """A whole item's content as one delta (a tool call, or text not streamed live)."""
        if isinstance(item, FunctionCall):
            return [
                ArgumentsDeltaEvent(
                    sequence_number=self._n(), item_id=item.id, output_index=index, delta=item.arguments
                )
            ]
        text = item.content[0].text
        return [self._delta(index, item.id, text)] if text else []

    def _closed(self, index: int, item: OutputMessage | FunctionCall) -> list[Event]:
        events: list[Event] = []
        if isinstance(item, FunctionCall):
            events.append(
                ArgumentsDoneEvent(
                    sequence_number=self._n(), item_id=item.id, output_index=index, arguments=item.arguments
                )
            )
        else:
            part = item.content[0]
            events.append(
                TextDoneEvent(
                    sequence_number=self._n(), item_id=item.id, output_index=index, content_index=0, text=part.text
                )
            )
            events.append(self._part("response.content_part.done", index, item.id, part))
        events.append(
            OutputItemEvent(type="response.output_item.done", sequence_number=self._n(), output_index=index, item=item)
        )
        return events

    def _part(self, kind: Any, index: int, item_id: str, part: OutputText) -> ContentPartEvent:
        return ContentPartEvent(
            type=kind, sequence_number=self._n(), item_id=item_id, output_index=index, content_index=0, part=part
        )

    def _delta(self, index: int, item_id: str, delta: str) -> TextDeltaEvent:
        return TextDeltaEvent(
            sequence_number=self._n(), item_id=item_id, output_index=index, content_index=0, delta=delta
        )


def sse_event(event: Event) -> str:
    """A server-sent event as OpenAI writes them: named by its type."""
    return f"event: {event.type}\ndata: {dumps(event.model_dump(mode='json'))}\n\n"
