"""The one adapter over the grammar library (xgrammar): compile constraints, match tokens, fill masks.

Why xgrammar (measured on the tiny model's 3000-token byte-level BPE, see the README): its
matchers fill a next-token mask in ~1-2 us median (llguidance 1.9: ~20-24 us, with multi-ms
spikes while its lexer warms up), it supports more JSON-schema keywords than llguidance here
(``not``, ``if``/``then``, ``uniqueItems`` compile; llguidance rejects them), it takes EBNF and
Lark, and it exposes exactly the pieces the batch needs (per-row matcher, int32 token bitmask).

Compiling happens before admission, off the step thread, bounded in input size, time and
memory: each constraint is first compiled in a sandbox process (``grammar_pool``) that is killed
when it overruns, and only then here; results go to an LRU keyed by the constraint, one cache
per tokenizer.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import xgrammar as xgr

from worker.logits_processor.grammar_pool import (
    GrammarPool,
    Outcome,
    TokenizerSnapshot,
    Verdict,
    shared_pool,
)
from worker.logits_processor.grammar_worker import compile_spec
from worker.structured_outputs import MAX_CONSTRAINT_BYTES, StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
# What the compiled grammars a compiler keeps may hold in all (vLLM's VLLM_XGRAMMAR_CACHE_MB is
# 512 too): one within-bound JSON schema can compile to tens of MiB, so a count alone would let
# 256 distinct heavy schemas pin gigabytes in the ingress and in every worker.
CACHE_BYTES = 512 << 20
REJECTED_CACHE_SIZE = 256
# Rejections that a retry would meet again (a timeout may not: it depends on the load).
_REMEMBERED = frozenset({Outcome.INVALID, Outcome.MEMORY, Outcome.CRASHED})

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: .*? is false: )?")

_WHAT = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "JSON object grammar",
}


def _library_message(text: str) -> str:
    """xgrammar's message: its first line, without the timestamp and source-file prefix."""
    text = text.strip()
    return _XGR_PREFIX.sub("", text.splitlines()[0]) if text else "rejected by the grammar compiler"


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

    @cached_property
    def nbytes(self) -> int:
        """What keeping it costs: xgrammar's own figure for the grammar, plus the mask."""
        keep = 0 if self.keep is None else self.keep.numel() * self.keep.element_size()
        return int(self.grammar.memory_size_bytes) + keep


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
    """The (words,) int32 bitmask with exactly ``ids`` (those in the vocabulary) set.

    Built in Python, not with vocabulary-sized tensor ops: it runs when a compiler is made, on
    whichever thread prepares a request, and a torch op that large would run as an OpenMP
    parallel region there, leaving that thread a team that throttles the step thread's
    (worker.model.host_threads).
    """
    words = [0] * bitmask_words(vocab_size)
    for t in ids:
        if 0 <= t < vocab_size:
            words[t >> 5] |= 1 << (t & 31)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _set_bits(row: torch.Tensor, ids: frozenset[int]) -> None:
    row |= _bits_of(sorted(ids), row.numel() * 32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# Bytes tried first when searching for an output: closers, so JSON reaches its end quickly.
_PREFERRED = b'"}]0,:{[ 1ae'
EMPTINESS_NODES = 512
ADMITS_NOTHING = (
    "no output satisfies it (no token can continue it: e.g. it needs a raw control character, "
    "which JSON forbids in a string, or its conditions contradict each other)"
)


class _Bytes:
    """The vocabulary's single-byte tokens, in search order; complete only for byte-level vocabularies."""

    def __init__(self, info: xgr.TokenizerInfo) -> None:
        ids: dict[int, int] = {}
        for t, text in enumerate(info.decoded_vocab):
            if len(text) == 1:
                ids.setdefault(text[0], t)
        self.complete = len(ids) == 256
        order = [b for b in _PREFERRED if b in ids] + sorted(set(ids) - set(_PREFERRED))
        self.ids = [ids[b] for b in order]
        self.printable = [ids[b] for b in order if b >= 0x20]  # what the JSON keep mask lets through


def admits_nothing(compiled: CompiledConstraint, tokens: Sequence[int], budget: int = EMPTINESS_NODES) -> bool:
    """True only when proven: no byte string drawn from ``tokens`` (every byte the engine may
    emit, one token each) ever lets the grammar end. A bounded depth-first search over bytes,
    closers first; False as soon as one output is found, or when the budget runs out (unknown)."""
    m = xgr.GrammarMatcher(compiled.grammar)
    mask = torch.zeros(1, bitmask_words(compiled.vocab_size), dtype=torch.int32)
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    stops = torch.tensor(sorted(compiled.stop_ids), dtype=torch.int64)

    def options() -> list[int] | None:
        """The bytes the grammar allows next; None when it may end here."""
        if m.is_terminated():
            return None
        m.fill_next_token_bitmask(mask, 0)
        if stops.numel() and bool(((mask[0, stops >> 5] >> (stops & 31)) & 1).any()):
            return None
        return ids[((mask[0, ids >> 5] >> (ids & 31)) & 1).bool()].tolist()

    first = options()
    if first is None:
        return False
    stack = [iter(first)]
    for _ in range(budget):
        while stack and (t := next(stack[-1], -1)) < 0:  # -1: this level's bytes are exhausted
            stack.pop()
            if stack:
                m.rollback(1)
        if not stack:
            return True
        if m.accept_token(t):
            nxt = options()
            if nxt is None:
                return False
            stack.append(iter(nxt))
    return False


class CompileBusy(ValueError):
    """Every compile worker stayed taken past its queue bound: retry later (HTTP 503)."""

    http_status = 503


class _Rejected(Exception):
    """A compile's verdict other than OK, carried through the pending future."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.outcome.value)
        self.verdict = verdict


class _Inline(Executor):
    """Runs the owner's compile in its own thread (it waits on the pool anyway); tests swap in
    executors that reorder completions (tests/worker/test_grammar_compiler_concurrency.py)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


class StructuredCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer: size-bounded, sandboxed, cached.

    A miss is checked against ``max_spec_bytes``, then compiled in a ``GrammarPool`` worker
    process (killed at ``timeout_s``; the process's shared pool unless ``pool`` is given); only
    a constraint that compiled there within its bounds is compiled here. Results go to an LRU
    keyed by the constraint and bounded in entries and in bytes (``cache_bytes``); rejections
    that would repeat (invalid, over the memory budget, crashing the compiler) go to a small
    negative cache, so a client repeating one costs nothing.
    """

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        *,
        cache_size: int = CACHE_SIZE,
        cache_bytes: int = CACHE_BYTES,
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_spec_bytes: int = MAX_CONSTRAINT_BYTES,
        pool: GrammarPool | None = None,
    ) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self.stop_ids = frozenset(int(t) for t in info.stop_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cached_bytes = 0
        self.timeout_s = timeout_s
        self.max_spec_bytes = max_spec_bytes
        self._own_pool = pool
        self._xgr = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._rejected: OrderedDict[tuple[str, str], Verdict] = OrderedDict()
        self._pending: dict[tuple[str, str], Future[CompiledConstraint]] = {}
        self._lock = threading.Lock()
        self._dispatch: Executor = _Inline()
        self._snapshot: TokenizerSnapshot | None = None
        self._json_keep = _bits_of(
            [t for t, text in enumerate(info.decoded_vocab) if t in self.stop_ids or not _CONTROL.search(text)],
            self.vocab_size,
        )
        self._bytes = _Bytes(info)
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
        cls, tokens: list[str] | list[bytes], stop_token_ids: Sequence[int], *, vocab_size: int | None = None, **kw: Any
    ) -> StructuredCompiler:
        """From each token's decoded text (empty = special, never matched)."""
        info = xgr.TokenizerInfo(
            tokens, xgr.VocabType.RAW, vocab_size=vocab_size or len(tokens), stop_token_ids=list(stop_token_ids)
        )
        return cls(info, **kw)

    @property
    def pool(self) -> GrammarPool:
        return self._own_pool if self._own_pool is not None else shared_pool()

    # -- compiling -----------------------------------------------------------------------

    def compile(self, so: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled constraint (cached); ValueError naming the field when invalid, too large,
        too slow or too big to compile (``CompileBusy`` when no compile worker came free).

        Lock discipline: the lock guards only the caches and the pending table and is never held
        while anything else runs (no submit, no future callback, no compile). An earlier version
        registered ``add_done_callback`` under the lock; a compile that had already finished ran
        its callback at once in this thread, which then waited forever for its own lock.
        """
        key = (so.kind, so.spec)
        self._check_size(so, key[1])
        with self._lock:
            hit = self._cache.get(key)
            rejected = self._rejected.get(key) if hit is None else None
            if hit is not None or rejected is not None:
                (self._cache if hit is not None else self._rejected).move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                fut = self._pending.get(key)
                owner = fut is None
                if fut is None:
                    fut = self._pending[key] = Future()
        if hit is not None:
            return hit
        if rejected is not None:
            raise self._error(so, rejected)
        assert fut is not None  # neither a hit nor a rejection: set under the lock above
        if owner:
            try:
                self._dispatch.submit(self._run, key, fut)
            except BaseException as exc:  # noqa: BLE001 - the executor is shut down: fail this compile, not the next
                self._finish(key, fut, None, exc)
        try:
            return fut.result(timeout=self.pool.answer_within_s(self.timeout_s) + self.timeout_s)
        except FutureTimeout:
            raise self._error(so, Verdict(Outcome.TIMEOUT)) from None
        except _Rejected as exc:
            raise self._error(so, exc.verdict) from None
        except Exception as exc:  # noqa: BLE001 - any library failure is the user's bad spec: a 400
            raise ValueError(f"{so.field_name}: invalid {_WHAT[so.kind]}: {_library_message(str(exc))}") from None

    def _check_size(self, so: StructuredOutputsParams, spec: str) -> None:
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > self.max_spec_bytes:
            raise ValueError(
                f"{so.field_name}: the {_WHAT[so.kind]} is {size} bytes, over the {self.max_spec_bytes} bytes "
                "a constraint may have (max_constraint_bytes)"
            )

    def _error(self, so: StructuredOutputsParams, verdict: Verdict) -> Exception:
        where, what = so.field_name, _WHAT[so.kind]
        outcome = verdict.outcome
        if outcome is Outcome.INVALID:
            return ValueError(f"{where}: invalid {what}: {_library_message(verdict.message)}")
        if outcome is Outcome.TIMEOUT:
            return ValueError(
                f"{where}: compiling the {what} took longer than {self.timeout_s:g}s; simplify the constraint"
            )
        if outcome is Outcome.MEMORY:
            mib = self.pool.config.memory_bytes >> 20
            return ValueError(
                f"{where}: compiling the {what} needs more than the {mib} MiB compile memory budget; "
                "simplify the constraint"
            )
        if outcome is Outcome.CRASHED:
            return ValueError(
                f"{where}: the grammar compiler failed on this {what} ({verdict.message}); simplify the constraint"
            )
        if outcome is Outcome.BUSY:
            return CompileBusy(f"{where}: every grammar compile worker is busy; retry later")
        return RuntimeError(f"{where}: grammar compiling is unavailable: {verdict.message}")

    def _run(self, key: tuple[str, str], fut: Future[CompiledConstraint]) -> None:
        """The owner's compile, published to the cache and to every waiter."""
        try:
            compiled = self._vouched_compile(*key)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter through the future
            self._finish(key, fut, None, exc)
        else:
            self._finish(key, fut, compiled, None)

    def _vouched_compile(self, kind: str, spec: str) -> CompiledConstraint:
        """The sandbox's verdict, then (if OK) the compile here: a computation known to finish."""
        verdict = self.pool.run(kind, spec, self._tokenizer_snapshot(), self.timeout_s)
        if verdict.outcome is not Outcome.OK:
            raise _Rejected(verdict)
        try:
            compiled = self._compile_now(kind, spec)
        except Exception as exc:  # noqa: BLE001 - the sandbox compiled it, so this should too
            raise _Rejected(Verdict(Outcome.INVALID, str(exc))) from None
        if self._admits_nothing(compiled):
            raise _Rejected(Verdict(Outcome.INVALID, ADMITS_NOTHING))
        return compiled

    def _admits_nothing(self, compiled: CompiledConstraint) -> bool:
        """Proven unsatisfiable (the engine would find no token to sample): a 400, not a failed
        generation. Searched over bytes, so only where every byte has its own token."""
        if not self._bytes.complete:
            return False
        return admits_nothing(compiled, self._bytes.ids if compiled.keep is None else self._bytes.printable)

    def _tokenizer_snapshot(self) -> TokenizerSnapshot:
        snap = self._snapshot
        if snap is None:  # built at most a few times (benign race), then kept
            text = self.info.serialize_json()
            snap = self._snapshot = TokenizerSnapshot(hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), text)
        return snap

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
                self._keep(key, compiled)
            elif isinstance(exc, _Rejected) and exc.verdict.outcome in _REMEMBERED:
                _put(self._rejected, key, exc.verdict, REJECTED_CACHE_SIZE)
        if compiled is not None:
            fut.set_result(compiled)
        else:
            fut.set_exception(exc if exc is not None else RuntimeError("compile failed"))

    def _keep(self, key: tuple[str, str], compiled: CompiledConstraint) -> None:
        """Into the LRU, then evict from its cold end past ``cache_size`` entries or
        ``cache_bytes`` in all; one larger than the whole budget is served, never kept.
        Called under the lock."""
        size = compiled.nbytes
        if size > self.cache_bytes:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self._cached_bytes -= old.nbytes
        self._cache[key] = compiled
        self._cached_bytes += size
        while len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.nbytes

    @property
    def cached_bytes(self) -> int:
        """What the kept compiled grammars hold now (``nbytes`` summed)."""
        return self._cached_bytes

    def _compile_now(self, kind: str, spec: str) -> CompiledConstraint:
        grammar = compile_spec(self._xgr, kind, spec)
        keep = self._json_keep if kind in ("json", "json_object") else None
        return CompiledConstraint(grammar, self.stop_ids, self.vocab_size, keep)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0
            self._rejected.clear()

    def __len__(self) -> int:
        return len(self._cache)


def _put(lru: OrderedDict[Any, Any], key: Any, value: Any, size: int) -> None:
    lru[key] = value
    lru.move_to_end(key)
    while len(lru) > size:
        lru.popitem(last=False)


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
