"""SamplingParams: what one request asks of the sampler, and its validation (docs/sampling.md "Validation and ranges").

Field names follow vLLM so that users and ported processors feel at home. Validation that
needs no model runs in ``__post_init__``; validation that needs the model's vocabulary runs in
``validate_for_model``. Both raise ``ValueError`` whose message starts with the field name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeGuard

from worker.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
DEFAULT_MAX_LOGPROBS = 20
# logprobs / prompt_logprobs = -1: every token of the vocabulary (vLLM's); as max_logprobs: no cap.
ALL_LOGPROBS = -1


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bad(name: str, value: object, rule: str) -> ValueError:
    return ValueError(f"{name}: {rule}, got {_shown(value)}")


def _shown(value: object) -> str:
    """``repr`` cut short: an error message must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# Fixed-width integer ranges (docs/sampling.md "Validation and ranges"): what the engine stores in
# int64 columns, and seeds.
INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # vLLM's range; the engine seeds with seed % 2**64


def _is_int_in(x: object, lo: int, hi: int) -> bool:
    return _is_int(x) and lo <= x <= hi


def _is_finite_number(x: object) -> bool:
    return _is_number(x) and math.isfinite(x)


def check_unicode(name: str, text: str) -> None:
    """ValueError naming ``name`` when ``text`` is not valid Unicode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name}: must be valid Unicode (lone surrogate at index {exc.start})") from None


def check_json_text(name: str, value: object, depth: int = 0) -> None:
    """Every key and string inside a JSON-like value is valid Unicode (no recursion past 100 levels)."""
    if depth > 100:
        raise ValueError(f"{name}: nested more than 100 levels deep")
    if isinstance(value, str):
        check_unicode(name, value)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                check_unicode(name, k)
            check_json_text(name, v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_json_text(name, v, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}: numbers must be finite, got {value!r}")


class Encoder(Protocol):
    """All ``update_from_tokenizer`` needs of a tokenizer (a transformers one, or a test's)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request.

    Greedy means ``temperature < 1e-5``; a greedy request ignores top_k, top_p and min_p.
    ``extra_args`` is the free-form JSON object custom logits processors read.

    Frozen: once validated, a request's parameters cannot change under the engine or a
    processor; derive a changed copy with ``dataclasses.replace`` (it validates again).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    logprobs_mode: LogprobsMode = "raw_logprobs"
    skip_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    # One output constraint (JSON schema, regex, choice, grammar, any JSON object); a dict is
    # converted. Enforced by the built-in StructuredOutputsLogitsProcessor.
    structured_outputs: StructuredOutputsParams | None = None
    # Logprobs of the prompt's own tokens plus the top-k at each prompt position (raw model
    # log-softmax, computed in the prefill forward); None: off.
    prompt_logprobs: int | None = None

    # Filled by the engine from the tokenizer / generation config before admission
    # (vLLM does the same): token-id forms of the bad words, and every stop token id
    # including the model's EOS ids (what Min-tokens masks).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The normal forms, set once here (the dataclass is frozen).
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _set(self, "stop", list(stop or []))
        _set(self, "stop_token_ids", list(self.stop_token_ids or []))
        _set(self, "bad_words", list(self.bad_words or []))
        if self.logit_bias is not None:
            _set(self, "logit_bias", {_token_key(k): v for k, v in self.logit_bias.items()})
        if isinstance(self.extra_args, dict) and not self.extra_args:
            # An empty object means "no custom arguments"; vLLM-style validate_params
            # (`params.extra_args and ...`) would otherwise see {} instead of None.
            _set(self, "extra_args", None)
        if self.structured_outputs is not None:
            _set(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        self._validate()
        _set(self, "_all_stop_token_ids", set(self.stop_token_ids))

    # -- derived -------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    # -- validation ----------------------------------------------------------------------

    def _validate(self) -> None:
        if not _is_int_in(self.n, 1, INT64_MAX):
            raise _bad("n", self.n, "must be an integer >= 1")
        t = self.temperature
        if not _is_finite_number(t) or not 0.0 <= t <= 2.0:
            raise _bad("temperature", t, "must be a finite number in [0, 2]")
        if not _is_finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be a finite number in (0, 1]")
        if not _is_int_in(self.top_k, -1, INT64_MAX):
            raise _bad("top_k", self.top_k, f"must be 0 or -1 (disabled) or an integer in [1, {INT64_MAX}]")
        if not _is_finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be a finite number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_finite_number(v) or not -2.0 <= v <= 2.0:
                raise _bad(name, v, "must be a finite number in [-2, 2]")
        r = self.repetition_penalty
        if not _is_finite_number(r) or r <= 0.0:
            raise _bad("repetition_penalty", r, "must be a finite number > 0")
        if self.seed is not None and not _is_int_in(self.seed, SEED_MIN, SEED_MAX):
            raise _bad("seed", self.seed, f"must be an integer in [-2**63, 2**64) = [{SEED_MIN}, {SEED_MAX}]")
        if not _is_int_in(self.max_tokens, 1, INT64_MAX):
            raise _bad("max_tokens", self.max_tokens, f"must be an integer in [1, {INT64_MAX}]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise _bad("stop", s, "stop strings must be non-empty strings")
            check_unicode("stop", s)
        for w in self.bad_words:
            if not isinstance(w, str) or w.strip() == "":
                raise _bad("bad_words", w, "bad words must be non-empty strings")
            check_unicode("bad_words", w)
        for tok in self.stop_token_ids:
            if not _is_int_in(tok, 0, INT64_MAX):
                raise _bad("stop_token_ids", tok, "token ids must be integers >= 0")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise _bad("allowed_token_ids", self.allowed_token_ids, "must not be empty")
            for tok in self.allowed_token_ids:
                if not _is_int_in(tok, 0, INT64_MAX):
                    raise _bad("allowed_token_ids", tok, "token ids must be integers >= 0")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not 0 <= tok <= INT64_MAX:
                    raise _bad("logit_bias", tok, "token ids must be integers >= 0")
                if not _is_finite_number(bias):
                    raise _bad("logit_bias", bias, f"bias of token {tok} must be a finite number")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not _is_int_in(k, ALL_LOGPROBS, INT64_MAX):
                raise _bad(name, k, "must be an integer >= 0, or -1 for the whole vocabulary")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise _bad("logprobs_mode", self.logprobs_mode, f"must be one of {LOGPROBS_MODES}")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise _bad("extra_args", self.extra_args, "must be a JSON object (dict)")
            check_json_text("extra_args", self.extra_args)

    def validate_for_model(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """Checks that need the model: token ids inside the vocabulary, the logprobs cap.

        The standard rules run again first: a caller may have bypassed the frozen fields.
        """
        self._validate()
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logit_bias", (self.logit_bias or {}).keys()),
        ):
            for tok in ids:
                if tok >= vocab_size:
                    raise _bad(name, tok, f"token id out of vocabulary (vocab_size={vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            n = vocab_size if k == ALL_LOGPROBS else k
            if n is not None and max_logprobs != ALL_LOGPROBS and n > max_logprobs:
                whole = f" (max_logprobs; -1 is the whole vocabulary, {vocab_size})" if k == ALL_LOGPROBS else ""
                raise _bad(name, k, f"must be <= {max_logprobs}{whole}")

    def resolved(self, vocab_size: int) -> SamplingParams:
        """These params with -1 logprobs (the whole vocabulary, vLLM's) as ``vocab_size``: what the
        engine and the response-size limits count. ``self`` when there is nothing to resolve."""
        if ALL_LOGPROBS not in (self.logprobs, self.prompt_logprobs):
            return self
        logprobs = vocab_size if self.logprobs == ALL_LOGPROBS else self.logprobs
        prompt = vocab_size if self.prompt_logprobs == ALL_LOGPROBS else self.prompt_logprobs
        return dataclasses.replace(self, logprobs=logprobs, prompt_logprobs=prompt)

    # -- engine-side completion ----------------------------------------------------------

    def update_from_tokenizer(self, tokenizer: Encoder, eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        """Tokenize bad words (bare and with a leading space, both kept) and collect stop ids: the
        engine-side caches (not fields a caller sets), filled before admission as vLLM does."""
        words: list[list[int]] = []
        for word in self.bad_words:
            for form in (word.lstrip(), " " + word.lstrip()):
                ids = list(tokenizer.encode(form, add_special_tokens=False))
                if ids and ids not in words:
                    words.append(ids)
        _set(self, "_bad_words_token_ids", words)
        stops = set(self.stop_token_ids)
        if not self.ignore_eos:
            stops |= set(eos_token_ids)
        _set(self, "_all_stop_token_ids", stops)


def _set(params: SamplingParams, name: str, value: object) -> None:
    """The one way to write a frozen field: normal forms and engine-side caches only."""
    object.__setattr__(params, name, value)


def _token_key(k: object) -> int:
    """logit_bias keys arrive as strings over JSON; anything not an integer is rejected."""
    if _is_int(k):
        return k
    if isinstance(k, str):
        try:
            return int(k)
        except ValueError:
            pass
    raise _bad("logit_bias", k, "keys must be integer token ids")
