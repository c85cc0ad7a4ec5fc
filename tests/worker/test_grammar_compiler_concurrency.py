"""StructuredCompiler's lock discipline: no ordering of compile completion, callers and keys hangs.

The first test reproduces the deadlock of the last hardening round: a compile that had already
finished when its done-callback was registered ran that callback at once, in the caller's thread,
under the caller's own (non-reentrant) lock. Every later constrained request then hung.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.logits_processor.structured_grammar import StructuredCompiler
from worker.structured_outputs import StructuredOutputsParams

VOCAB = ["<eos>", "a", "b", "c", "{", "}", '"', ":", ",", " ", "1", "2", "x", "y", "[", "]", "true", "null"]
EOS = 0
# Generous: each compile here takes milliseconds; a hang is what this bound catches, not speed.
JOIN_S = 60.0

VALID = [{"regex": "a+"}, {"regex": "(ab)*c"}, {"choice": ["x", "y"]}, {"json": {"type": "object"}}]
INVALID = [{"regex": "("}, {"regex": "\ud800"}, {"json": {"type": "no-such-type"}}, {"grammar": "root ::= ("}]


def _params(d: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(**d)


def _call(fn: Callable[[], object]) -> tuple[str, object]:
    try:
        return "ok", fn()
    except ValueError as exc:
        return "error", str(exc)


def _in_thread(fn: Callable[[], object]) -> tuple[str, object]:
    """Run ``fn`` in a thread with a join bound; a hang fails the test instead of the suite."""
    box: list[tuple[str, object]] = []
    t = threading.Thread(target=lambda: box.append(_call(fn)), daemon=True)
    t.start()
    t.join(JOIN_S)
    assert not t.is_alive(), "compile() hung: a lock is held across a callback"
    return box[0]


class InlineExecutor(Executor):
    """Runs each task at submit time: the compile has finished before submit() returns."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - a Future carries any exception, as the executor's does
            fut.set_exception(exc)
        return fut


class GatedExecutor(Executor):
    """Holds tasks until the test releases them, in an order the test chooses."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.tasks.append((fn, args, fut))
        return fut

    def run(self, index: int) -> None:
        fn, args, fut = self.tasks.pop(index)
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - a Future carries any exception, as the executor's does
            fut.set_exception(exc)


@pytest.fixture(scope="module")
def warm() -> None:
    StructuredCompiler.from_vocab(VOCAB, [EOS]).compile(_params(VALID[0]))  # xgrammar's own first-use cost


@pytest.mark.parametrize("so", VALID + INVALID, ids=lambda d: next(iter(d)))
def test_compile_that_finished_before_registration_does_not_hang(so: dict[str, Any], warm: None) -> None:
    c = StructuredCompiler.from_vocab(VOCAB, [EOS])
    c._dispatch = InlineExecutor()  # the worst ordering, made certain
    first = _in_thread(lambda: c.compile(_params(so)))
    second = _in_thread(lambda: c.compile(_params(VALID[1])))  # the next constrained request
    assert second[0] == "ok"
    assert first[0] == ("ok" if so in VALID else "error")
    assert c._pending == {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    keys=st.lists(st.integers(0, len(VALID) + len(INVALID) - 1), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_completion_order_resolves_every_caller(keys: list[int], seed: int, warm: None) -> None:
    """Callers on random keys (duplicates share one compile); tasks finish in a random order,
    interleaved with the callers' arrival. Every caller gets its answer, the cache holds exactly
    the valid keys, nothing stays pending."""
    rng = random.Random(seed)
    c = StructuredCompiler.from_vocab(VOCAB, [EOS], timeout_s=JOIN_S)
    gate = GatedExecutor()
    c._dispatch = gate
    specs = VALID + INVALID
    results: dict[int, tuple[str, object]] = {}
    threads = []
    for i, k in enumerate(keys):
        t = threading.Thread(
            target=lambda i=i, k=k: results.__setitem__(i, _call(lambda: c.compile(_params(specs[k]))))
        )
        t.start()
        threads.append(t)
        while gate.tasks and rng.random() < 0.5:  # release some pending compiles before the next caller
            gate.run(rng.randrange(len(gate.tasks)))
    for t in threads:
        # Drain whatever is still gated (a late caller may have submitted after the last drain).
        while t.is_alive():
            while gate.tasks:
                gate.run(rng.randrange(len(gate.tasks)))
            t.join(0.01)
    for i, k in enumerate(keys):
        assert results[i][0] == ("ok" if k < len(VALID) else "error"), (specs[k], results[i])
    assert c._pending == {}
    assert set(c._cache) == {(_params(specs[k]).kind, _params(specs[k]).spec) for k in keys if k < len(VALID)}
    # One compile per distinct key at most (a cached or pending key never compiles twice).
    assert c.misses >= len(set(keys))


def test_many_threads_on_the_real_pool(warm: None) -> None:
    c = StructuredCompiler.from_vocab(VOCAB, [EOS], timeout_s=JOIN_S)
    specs = VALID + INVALID + [{"regex": f"a{{{i}}}b"} for i in range(1, 9)]
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            so = specs[rng.randrange(len(specs))]
            kind, res = _call(lambda so=so: c.compile(_params(so)))
            if (kind == "ok") != (so not in INVALID):
                errors.append(AssertionError((so, kind, res)))
            if rng.random() < 0.05:
                c.clear()

    threads = [threading.Thread(target=hammer, args=(s,), daemon=True) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a compile hung"
    assert errors == []
    assert c._pending == {}
