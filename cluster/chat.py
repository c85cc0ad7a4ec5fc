"""Chat turns into a prompt, and max_tokens against the context: rules of the front end, not of
any one protocol (the OpenAI adapter turns its messages into (role, text) turns; gRPC could too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.sampling_params import INT64_MAX, SamplingParams

# (role, text): one chat turn, as the front end takes it.
Turn = tuple[str, str]

# Used when the tokenizer has no chat template of its own (documented in the README).
DEFAULT_CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>\n"


def render_chat(tokenizer: Any, turns: Sequence[Turn]) -> str:
    """The tokenizer's chat template over ``turns``, with the assistant's generation prompt."""
    msgs = [{"role": role, "content": text} for role, text in turns]
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=template)


def fit_to_context(params: SamplingParams, prompt_len: int, max_model_len: int) -> None:
    """max_tokens against the context the prompt leaves, as vLLM: "up to the context" (INT64_MAX,
    chat's value when neither max_tokens nor max_completion_tokens is given) becomes what is
    left, and min_tokens is capped with it; a number that does not fit is a ValueError (400)."""
    room = max_model_len - prompt_len
    if params.max_tokens == INT64_MAX:
        params.max_tokens = max(1, room)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
    elif params.max_tokens > room:
        raise ValueError(
            f"max_tokens: This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {params.max_tokens} output tokens and your prompt contains {prompt_len} input "
            f"tokens, for a total of {prompt_len + params.max_tokens} tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens."
        )
