"""Known request fields this server does not implement: a 400 naming the field, never silently
ignored. Unknown fields are still ignored (newer SDKs add fields); a known one means the client
expects a behaviour this server would not give.

The tables cover OpenAI's fields and every extra field of vLLM's request models (its
``protocol.py``: ``CompletionRequest``, ``ChatCompletionRequest``, ``StreamOptions``) that
cluster.openai.protocol does not implement; tests/cluster_rayfree/test_openai_fields.py keeps vLLM's list
and checks that each of its fields is either implemented or here. A field is refused only when
it asks for something: its value is neither null nor one of ``accepted`` (the values meaning
"off", which clients often send explicitly, e.g. ``use_beam_search: false``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Unimplemented:
    why: str
    accepted: tuple[Any, ...] = ()

    def asks(self, value: Any) -> bool:
        """Whether ``value`` asks for the missing behaviour."""
        return value is not None and value not in self.accepted


_FIXED_BACKEND = Unimplemented("the backend is fixed (xgrammar)")
_NO_MULTIMODAL = Unimplemented("the model is text-only")

# Both /v1/completions and /v1/chat/completions.
SAMPLING: Mapping[str, Unimplemented] = {
    # OpenAI's
    "functions": Unimplemented("use tools"),
    "function_call": Unimplemented("use tool_choice"),
    "prediction": Unimplemented("predicted outputs are not supported"),
    "audio": Unimplemented("audio output is not supported"),
    "modalities": Unimplemented("only text output is supported"),
    "web_search_options": Unimplemented("web search is not supported"),
    # vLLM's
    "guided_decoding_backend": _FIXED_BACKEND,
    "guided_whitespace_pattern": Unimplemented("JSON is generated compactly"),
    "structural_tag": Unimplemented("structural tags are not supported"),
    "best_of": Unimplemented("best_of is not supported (vLLM v1 dropped it too); use n", (1,)),
    "use_beam_search": Unimplemented("beam search is not supported", (False,)),
    "length_penalty": Unimplemented("it applies to beam search, which is not supported", (1.0,)),
    "watermarking": Unimplemented("watermarking is not supported", (False,)),
    "spaces_between_special_tokens": Unimplemented("special tokens are detokenized as the tokenizer does", (True,)),
    "logprob_token_ids": Unimplemented("logprobs come as the top-k only"),
    "logits_processors": Unimplemented("processors are loaded at start-up; enable one with vllm_xargs"),
    "request_id": Unimplemented("the server assigns request ids"),
    "session_id": Unimplemented("sessions are not supported"),
    "return_tokens_as_token_ids": Unimplemented("logprob tokens are always text", (False,)),
    "routed_experts_prompt_start": Unimplemented("no routed-expert data is returned", (0,)),
    "return_token_offsets": Unimplemented("only the render endpoints have it, which this server lacks", (False,)),
    "return_mm_kwargs": Unimplemented("only the render endpoints have it, which this server lacks", (True,)),
    "cache_salt": Unimplemented("the prefix cache is not salted"),
    "kv_transfer_params": Unimplemented("disaggregated serving is not supported"),
    "ec_transfer_params": Unimplemented("disaggregated serving is not supported"),
    "repetition_detection": Unimplemented("repetition detection is not supported"),
    "thinking_token_budget": Unimplemented("there is no reasoning parser", (-1,)),
    "stream_interval": Unimplemented("the stream interval is the server's (workers.stream_interval_s)"),
}

COMPLETION: Mapping[str, Unimplemented] = {
    **SAMPLING,
    "prompt_embeds": Unimplemented("prompts are text or token ids"),
}

CHAT: Mapping[str, Unimplemented] = {
    **SAMPLING,
    # OpenAI's: only reasoning models take it (OpenAI answers other models with a 400 too).
    "reasoning_effort": Unimplemented("there is no reasoning parser"),
    # vLLM's
    "include_reasoning": Unimplemented("there is no reasoning parser", (True,)),
    "echo": Unimplemented("chat echo is not supported (completions' echo is)", (False,)),
    "documents": Unimplemented("the chat template gets no documents"),
    "chat_template": Unimplemented("the chat template is the tokenizer's"),
    "chat_template_kwargs": Unimplemented("the chat template gets no extra arguments"),
    "media_io_kwargs": _NO_MULTIMODAL,
    "mm_processor_kwargs": _NO_MULTIMODAL,
    "return_prompt_text": Unimplemented("the rendered prompt is not returned", (False,)),
}

# /tokenize with `messages` (vLLM's TokenizeChatRequest).
TOKENIZE_CHAT: Mapping[str, Unimplemented] = {
    "chat_template": CHAT["chat_template"],
    "chat_template_kwargs": CHAT["chat_template_kwargs"],
    "media_io_kwargs": _NO_MULTIMODAL,
    "mm_processor_kwargs": _NO_MULTIMODAL,
}

# stream_options (vLLM's StreamOptions).
STREAM_OPTIONS: Mapping[str, Unimplemented] = {
    "continuous_usage_stats": Unimplemented("usage comes once, in the last chunk", (False,)),
}


# /v1/responses (OpenAI's ResponseCreateParams; vLLM's ResponsesRequest extras): stored state,
# background runs, built-in tools and what needs a reasoning parser or more output data.
_NOT_STORED = "this server stores no responses: send the whole conversation as input"
RESPONSES: Mapping[str, Unimplemented] = {
    "previous_response_id": Unimplemented(_NOT_STORED),
    "conversation": Unimplemented(_NOT_STORED),
    "store": Unimplemented("responses are not stored; set store=false or leave it out", (False,)),
    "background": Unimplemented("background responses are not supported (they need stored responses)", (False,)),
    "background_options": Unimplemented("background responses are not supported"),
    "prompt": Unimplemented("stored prompt templates are not supported"),
    "include": Unimplemented("no extra output data is returned", ([],)),
    "reasoning": CHAT["reasoning_effort"],
    "max_tool_calls": Unimplemented("built-in tools are not supported; the caller runs function calls"),
    "context_management": Unimplemented("context management (compaction) is not supported"),
    "truncation": Unimplemented("a prompt past the context is a 400, never truncated", ("disabled",)),
    "top_logprobs": Unimplemented("output logprobs are not returned by /v1/responses", (0,)),
    "service_tier": Unimplemented("there is one service tier", ("auto", "default")),
    "prompt_cache_key": SAMPLING["cache_salt"],
    "prompt_cache_retention": Unimplemented("the prefix cache keeps what the engine's cache holds"),
    "prompt_cache_options": Unimplemented("the prefix cache keeps what the engine's cache holds"),
    "moderation": Unimplemented("moderation is not supported"),
    "image": _NO_MULTIMODAL,
    "access_programs": Unimplemented("OpenAI's access programs do not apply here"),
    # vLLM's
    "request_id": SAMPLING["request_id"],
    "cache_salt": SAMPLING["cache_salt"],
    "enable_response_messages": Unimplemented("the rendered messages are not returned", (False,)),
    "previous_input_messages": Unimplemented(_NOT_STORED),
    "mm_processor_kwargs": _NO_MULTIMODAL,
}
# /v1/responses `text` and `stream_options`.
RESPONSES_TEXT: Mapping[str, Unimplemented] = {
    "verbosity": Unimplemented("the model has no verbosity setting", ("medium",)),
}
RESPONSES_STREAM_OPTIONS: Mapping[str, Unimplemented] = {
    "include_obfuscation": Unimplemented("stream events are not padded", (False,)),
}


def reject(body: Any, table: Mapping[str, Unimplemented], prefix: str = "") -> None:
    """ValueError for the first field of ``table`` that ``body`` (a raw request object) sets."""
    if isinstance(body, dict):
        for name, field in table.items():
            if name in body and field.asks(body[name]):
                raise ValueError(f"{prefix}{name}: not implemented by this server ({field.why})")
