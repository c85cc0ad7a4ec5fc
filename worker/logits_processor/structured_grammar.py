"""The one adapter over the grammar library (xgrammar): compile constraints, match tokens, fill masks.

Why xgrammar (measured on the tiny model's 3000-token byte-level BPE, see the README): its
matchers fill a next-token mask in ~1-2 us median (llguidance 1.9: ~20-24 us, with multi-ms
spikes while its lexer warms up), it supports more JSON-schema keywords than llguidance here
(``not``, ``if``/``then``, ``uniqueItems`` compile; llguidance rejects them), it takes EBNF and
Lark, and it exposes exactly the pieces the batch needs (per-row matcher, int32 token bitmask).

Compiling happens before admission, off the step thread, in a small thread pool with a time
bound (xgrammar releases the GIL while compiling); results go to an LRU keyed by the constraint,
one cache per tokenizer. A compile that overruns its bound is answered with a ValueError at
once and still lands in the cache when it finishes.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from worker.structured_outputs import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
_COMPILE_THREADS = 2

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: .*? is false: )?")

_WHAT = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "JSON object grammar",
}


def _library_message(exc: BaseException) -> str:
    """xgrammar's message without its timestamp and source-file prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_PREFIX.sub("", text)


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one tokenizer; ``matcher()`` starts a row at its beginning."""

    grammar: xgr.CompiledGrammar
    stop_ids: frozenset[int]
    vocab_size: int
    # JSON kinds only: the (words,) int32 bitmask of tokens without a raw control character.
    # xgrammar 0.2.8's rule for length-bounded strings (maxLength) admits bytes 0x00-0x1f, which
    # JSON never allows unescaped; ANDing this in after the fill keeps the output valid JSON.
    keep: torch.Tensor | None = None

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)


class GrammarMatcher:
    """One row's position in its grammar.

    ``accept`` consumes one sampled token. A stop token after the grammar terminated is a no-op
    (``ignore_eos`` keeps a request going); a token the grammar rejects (only possible when
    something bypassed the mask) makes the row dead: from then on it allows no token, so the
    engine ends that request with an error instead of emitting text that breaks the grammar.
    """

    def __init__(self, compiled: CompiledConstraint) -> None:
        self._m = xgr.GrammarMatcher(compiled.grammar)
        self._stop = compiled.stop_ids
        self.keep = compiled.keep
        self.dead = False

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()

    def accept(self, token: int) -> bool:
        if self.dead:
            return False
        if self._m.is_terminated():
            self.dead = token not in self._stop
        else:
            self.dead = not self._m.accept_token(token)
        return not self.dead

    @property
    def handle(self) -> xgr.GrammarMatcher:
        return self._m


class MaskFiller:
    """Fills rows of one int32 bitmask for many matchers.

    One ``fill_next_token_bitmask`` per live row: measured at B=64 on 2 cores, this loop took
    0.75 ms where xgrammar's threaded ``BatchGrammarMatcher`` took 10-18 ms (thread hand-off on
    a busy machine), so the loop it is; the mask work itself is C++ either way.
    """

    def fill(self, matchers: Sequence[GrammarMatcher], rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """Row ``rows[i]`` of ``bitmask`` gets the tokens ``matchers[i]`` allows next.

        A terminated matcher allows only its stop tokens; a dead one allows nothing.
        """
        for m, row in zip(matchers, rows):
            if m.dead:
                bitmask[row] = 0
            elif m.terminated:
                bitmask[row] = 0
                _set_bits(bitmask[row], m._stop)
            else:
                m.handle.fill_next_token_bitmask(bitmask, row)
        groups: dict[int, tuple[torch.Tensor, list[int]]] = {}  # one group per compiler, in practice
        for m, row in zip(matchers, rows):
            if m.keep is not None and not m.terminated:
                groups.setdefault(id(m.keep), (m.keep, []))[1].append(row)
        for keep, idx in groups.values():
            bitmask[idx] &= keep


_CONTROL = re.compile(rb"[\x00-\x1f]")


def _bits_of(ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The (words,) int32 bitmask with exactly ``ids`` set."""
    bits = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.bool)
    bits[[t for t in ids if 0 <= t < vocab_size]] = True
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (bits.view(-1, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _set_bits(row: torch.Tensor, ids: frozenset[int]) -> None:
    row |= _bits_of(sorted(ids), row.numel() * 32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer, with an LRU cache and a time bound."""

    def __init__(
        self, info: xgr.TokenizerInfo, *, cache_size: int = CACHE_SIZE, timeout_s: float = COMPILE_TIMEOUT_S
    ) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self.stop_ids = frozenset(int(t) for t in info.stop_token_ids)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._xgr = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._pending: dict[tuple[str, str], Future[CompiledConstraint]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=_COMPILE_THREADS, thread_name_prefix="logitpool-grammar")
        self._json_keep = _bits_of(
            [t for t, text in enumerate(info.decoded_vocab) if t in self.stop_ids or not _CONTROL.search(text)],
            self.vocab_size,
        )
        self.hits = 0
        self.misses = 0

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None, **kw: Any
    ) -> StructuredCompiler:
        """From a Hugging Face tokenizer. Special tokens other than the stop tokens are never
        allowed by a grammar (xgrammar would otherwise match ``<|pad|>`` as literal text)."""
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        vocab = list(base.decoded_vocab)
        for t in getattr(tokenizer, "all_special_ids", ()):
            if 0 <= t < len(vocab) and t not in stop_token_ids:
                vocab[t] = b""
        return cls.from_vocab(vocab, list(stop_token_ids), vocab_size=vocab_size, **kw)

    @classmethod
    def from_vocab(
        cls, tokens: Sequence[str | bytes], stop_token_ids: Sequence[int], *, vocab_size: int | None = None, **kw: Any
    ) -> StructuredCompiler:
        """From each token's decoded text (empty = special, never matched)."""
        info = xgr.TokenizerInfo(
            list(tokens), xgr.VocabType.RAW, vocab_size=vocab_size or len(tokens), stop_token_ids=list(stop_token_ids)
        )
        return cls(info, **kw)

    # -- compiling -----------------------------------------------------------------------

    def compile(self, so: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled constraint (cached); ValueError naming the field when invalid or too slow.

        Lock discipline: the lock guards only the cache and the pending table and is never held
        while anything else runs (no submit, no future callback, no compile). An earlier version
        registered ``add_done_callback`` under the lock; a compile that had already finished ran
        its callback at once in this thread, which then waited forever for its own lock.
        """
        key = (so.kind, so.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
            fut = self._pending.get(key)
            owner = fut is None
            if fut is None:
                fut = self._pending[key] = Future()
        if owner:
            try:
                self._pool.submit(self._run, key, fut)
            except BaseException as exc:  # the pool is shut down: fail this compile, not the next
                self._finish(key, fut, None, exc)
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise ValueError(
                f"{so.field_name}: compiling the {_WHAT[so.kind]} took longer than {self.timeout_s:g}s; "
                "simplify the constraint"
            ) from None
        except Exception as exc:
            raise ValueError(f"{so.field_name}: invalid {_WHAT[so.kind]}: {_library_message(exc)}") from None

    def _run(self, key: tuple[str, str], fut: Future[CompiledConstraint]) -> None:
        """Pool thread: compile, publish to the cache, then resolve the waiters (outside the lock)."""
        try:
            compiled = self._compile_now(*key)
        except BaseException as exc:
            self._finish(key, fut, None, exc)
        else:
            self._finish(key, fut, compiled, None)

    def _finish(
        self,
        key: tuple[str, str],
        fut: Future[CompiledConstraint],
        compiled: CompiledConstraint | None,
        exc: BaseException | None,
    ) -> None:
        with self._lock:
            if self._pending.get(key) is fut:
                del self._pending[key]
            if compiled is not None:
                self._cache[key] = compiled
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if compiled is not None:
            fut.set_result(compiled)
        else:
            fut.set_exception(exc if exc is not None else RuntimeError("compile failed"))

    def _compile_now(self, kind: str, spec: str) -> CompiledConstraint:
        c = self._xgr
        if kind == "json":
            grammar = c.compile_json_schema(spec, any_whitespace=False)
        elif kind == "json_object":
            grammar = c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            grammar = c.compile_regex(spec)
        elif kind == "choice":
            choices = json.loads(spec)
            grammar = c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices))
        elif "::=" in spec:
            grammar = c.compile_grammar(spec)
        else:
            grammar = c.compile_lark(spec)
        keep = self._json_keep if kind in ("json", "json_object") else None
        return CompiledConstraint(grammar, self.stop_ids, self.vocab_size, keep)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)


_COMPILERS: dict[int, tuple[Any, StructuredCompiler]] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None) -> StructuredCompiler:
    """The process's compiler (and cache) for this tokenizer object, built on first use."""
    key = id(tokenizer)
    with _COMPILERS_LOCK:
        entry = _COMPILERS.get(key)
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, StructuredCompiler.from_tokenizer(tokenizer, vocab_size, stop_token_ids))
            _COMPILERS[key] = entry
        return entry[1]
