"""Chat turns into a prompt, how a prompt becomes token ids, and max_tokens against the context:
rules of the front end, not of any one protocol (the OpenAI adapter turns its messages into
(role, text) turns; gRPC could too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from worker.sampling_params import INT64_MAX, SamplingParams

# (role, text): one chat turn, as the front end takes it.
Turn = tuple[str, str]

# Used when the tokenizer has no chat template of its own (documented in the README).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ChatRender:
    """How the template renders a chat (vLLM's fields): the assistant's generation prompt after
    the turns (the default), or the last turn left open for the model to continue."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it to false)")


# The default: the assistant's generation prompt after the turns.
GENERATION_PROMPT = ChatRender()


def render_chat(
    tokenizer: Any,
    turns: Sequence[Turn],
    how: ChatRender = GENERATION_PROMPT,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The tokenizer's chat template over ``turns``, as text: it holds every special token the
    template writes (a leading ``{{ bos_token }}`` included), so it is tokenized without adding
    more (PromptTokens.add_special_tokens is false for chat, as vLLM). ``tools``: the OpenAI
    tool definitions, for templates that render them (as vLLM passes them)."""
    msgs = [{"role": role, "content": text} for role, text in turns]
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    try:
        return tokenizer.apply_chat_template(
            msgs,
            tokenize=False,
            add_generation_prompt=how.add_generation_prompt,
            continue_final_message=how.continue_final_message,
            chat_template=template,
            tools=tools,
        )
    except ValueError as exc:  # transformers: e.g. the final message is not where it can be continued
        field = "continue_final_message" if how.continue_final_message else "messages"
        raise ValueError(f"{field}: {exc}") from None


@dataclass(frozen=True)
class PromptTokens:
    """How a prompt becomes token ids (vLLM's fields). ``add_special_tokens``: the tokenizer's
    own (a BOS) on a text prompt — true for completions, false for a rendered chat, whose
    template writes its own. ``truncate_prompt_tokens`` k: keep the last k tokens (or the first
    k, ``truncation_side: right``); -1 is max_model_len."""

    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"

    def keep(self, max_model_len: int) -> int | None:
        """How many tokens to keep (None: all); ValueError when k cannot fit the context."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return max_model_len
        if k < 1:
            raise ValueError(f"truncate_prompt_tokens: must be -1 or >= 1, got {k}")
        if k > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens: {k} is greater than max_model_len ({max_model_len}); "
                "request a smaller truncation size"
            )
        return k

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        if keep is None or len(ids) <= keep:
            return ids
        return ids[-keep:] if self.truncation_side == "left" else ids[:keep]


# The defaults (vLLM's): a text prompt gets the tokenizer's special tokens, a rendered chat none.
TEXT_TOKENS = PromptTokens()
CHAT_TOKENS = PromptTokens(add_special_tokens=False)


def fit_to_context(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """max_tokens against the context the prompt leaves, as vLLM: "up to the context" (INT64_MAX,
    chat's value when neither max_tokens nor max_completion_tokens is given) becomes what is
    left, and min_tokens is capped with it (a new, frozen SamplingParams); a number that does
    not fit is a ValueError (400)."""
    room = max_model_len - prompt_len
    if params.max_tokens == INT64_MAX:
        max_tokens = max(1, room)
        return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
    if params.max_tokens > room:
        raise ValueError(
            f"max_tokens: This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {params.max_tokens} output tokens and your prompt contains {prompt_len} input "
            f"tokens, for a total of {prompt_len + params.max_tokens} tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens."
        )
    return params
