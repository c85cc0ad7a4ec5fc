"""check_processor: a conformance harness for logits-processor authors.

A batch-level processor must give every row exactly what it would give that request alone.
The harness drives a real ``PersistentBatch`` through random engine steps (requests join,
finish, condense and swap; output lists grow by one random token per step) and, each step,
compares every row of ``update_state`` + ``apply`` on the batch with a fresh reference instance
of the same processor that only ever saw that one request (added at row 0 when it joined,
``update_state(None)`` on every later step, same live output list, same logits row).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from worker.batch import PersistentBatch
from worker.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from worker.sampling_params import SamplingParams

# (config, device, is_pin_memory) -> processor; a LogitsProcessor subclass is one.
ProcessorFactory = Callable[[object, torch.device, bool], LogitsProcessor]
ParamsFactory = Callable[[random.Random], SamplingParams]

_ALPHABET = "abcde"


class ConformanceFailure(AssertionError):
    """The processor under test diverged from (or raised where) its batch-of-one reference."""

    def __init__(
        self, message: str, *, step: int, row: int | None, req_id: str | None, batch_update: BatchUpdate | None
    ) -> None:
        super().__init__(message)
        self.step = step
        self.row = row
        self.req_id = req_id
        self.batch_update = batch_update


class CharTokenizer:
    """A toy tokenizer, one token per character, so bad words have known token ids."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [(ord(ch) * 7) % self.vocab_size for ch in text]


def random_params(rng: random.Random, vocab_size: int, extra_args: dict[str, Any] | None = None) -> SamplingParams:
    """Random request parameters that exercise every built-in processor and sampler feature.

    Each feature is on for a fraction of requests; bad words and stop ids are filled as the
    engine would (``update_from_tokenizer`` with ``CharTokenizer``, EOS = ``vocab_size - 1``).
    Authors can call it from their own ``make_params`` and add their ``extra_args``.
    """

    def maybe(p: float) -> bool:
        return rng.random() < p

    min_tokens = rng.randint(1, 8) if maybe(0.4) else 0
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
        top_k=rng.choice([0, -1, 3, 20]),
        top_p=rng.choice([1.0, 0.8]),
        min_p=rng.uniform(0.05, 0.5) if maybe(0.4) else 0.0,
        repetition_penalty=rng.uniform(0.5, 2.0) if maybe(0.3) else 1.0,
        frequency_penalty=rng.uniform(-2.0, 2.0) if maybe(0.3) else 0.0,
        presence_penalty=rng.uniform(-2.0, 2.0) if maybe(0.3) else 0.0,
        seed=rng.randrange(2**31) if maybe(0.3) else None,
        max_tokens=64,
        min_tokens=min_tokens,
        stop_token_ids=[rng.randrange(vocab_size)] if maybe(0.3) else [],
        ignore_eos=maybe(0.1),
        logit_bias={rng.randrange(vocab_size): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}
        if maybe(0.3)
        else None,
        allowed_token_ids=rng.sample(range(vocab_size), rng.randint(1, 10)) if maybe(0.2) else None,
        bad_words=["".join(rng.choices(_ALPHABET, k=rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        if maybe(0.3)
        else [],
        extra_args=extra_args,
    )
    params.update_from_tokenizer(CharTokenizer(vocab_size), eos_token_ids={vocab_size - 1})
    return params


def describe_update(update: BatchUpdate | None, req_ids: Sequence[str] | None = None) -> str:
    """A one-line BatchUpdate with params elided; ``req_ids`` (order after it) names the adds."""
    if update is None:
        return "None"
    added = [str(i) if req_ids is None else f"{i}:{_added_id(update, i, req_ids)}" for i, *_ in update.added]
    moved = [f"{s}{'->' if k == MoveDirectionality.UNIDIRECTIONAL else '<->'}{d}" for s, d, k in update.moved]
    return (
        f"BatchUpdate(batch_size={update.batch_size}, removed={list(update.removed)}, "
        f"added=[{', '.join(added)}], moved=[{', '.join(moved)}])"
    )


def _added_id(update: BatchUpdate, index: int, req_ids: Sequence[str]) -> str:
    row = index  # follow the moves from the Add's index to the row it ends on
    for s, d, k in update.moved:
        if row == s:
            row = d
        elif k == MoveDirectionality.SWAP and row == d:
            row = s
    return req_ids[row] if row < len(req_ids) else "?"


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise exact equality where NaN equals NaN (and -inf equals -inf)."""
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


class _Run:
    """One harness run: the batch under test, the references, and the random churn."""

    def __init__(
        self,
        factory: ProcessorFactory,
        make_params: ParamsFactory,
        *,
        vocab_size: int,
        max_num_reqs: int,
        seed: int,
        config: object,
    ) -> None:
        self.factory = factory
        self.make_params = make_params
        self.vocab_size = vocab_size
        self.config = config
        self.device = torch.device("cpu")
        self.rng = random.Random(seed)
        self.logits_gen = torch.Generator().manual_seed(seed)
        self.batch = PersistentBatch(max_num_reqs)
        self.proc = factory(config, self.device, False)
        self.refs: dict[str, LogitsProcessor] = {}
        self.next_id = 0
        # token ids the toy tokenizer gives _ALPHABET, drawn often so bad words can match
        self.hot = [*CharTokenizer(vocab_size).encode(_ALPHABET), vocab_size - 1]

    def churn(self) -> tuple[list[str], list[tuple[str, SamplingParams, list[int], list[int]]], list[tuple[int, int]]]:
        rng, ids = self.rng, self.batch.req_ids
        finish_p = 0.6 if rng.random() < 0.05 else 0.12
        finished = [rid for rid in ids if rng.random() < finish_p]
        room = self.batch.max_num_reqs - (len(ids) - len(finished))
        n_new = 0 if room == 0 or rng.random() < 0.5 else rng.randint(1, min(3, room))
        new = []
        for _ in range(n_new):
            rid = f"req-{self.next_id}"
            self.next_id += 1
            params = self.make_params(rng)
            params.validate_for_model(self.vocab_size)
            type(self.proc).validate_params(params)
            prompt = [rng.randrange(self.vocab_size) for _ in range(rng.randint(0, 6))]
            output = [self._token() for _ in range(rng.randint(0, 3))] if rng.random() < 0.2 else []
            new.append((rid, params, prompt, output))
        size = len(ids) - len(finished) + n_new
        swaps: list[tuple[int, int]] = []
        if size >= 2 and rng.random() < 0.3:
            for _ in range(rng.randint(1, 2)):
                a, b = rng.sample(range(size), 2)
                swaps.append((a, b))
        return finished, new, swaps

    def _token(self) -> int:
        return self.rng.choice(self.hot) if self.rng.random() < 0.5 else self.rng.randrange(self.vocab_size)

    def step(self, step: int) -> None:
        finished, new, swaps = self.churn()
        update = self.batch.update(finished, new, swaps)
        ids = self.batch.req_ids

        def fail(msg: str, row: int | None = None, rid: str | None = None) -> ConformanceFailure:
            where = "" if row is None else f" row {row} (request {rid!r}):"
            return ConformanceFailure(
                f"step {step}:{where} {msg}; BatchUpdate of this step: {describe_update(update, ids)}",
                step=step,
                row=row,
                req_id=rid,
                batch_update=update,
            )

        for rid in finished:
            self.refs.pop(rid)
        for rid, params, prompt, output in new:
            ref = self.factory(self.config, self.device, False)
            ref.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, params, prompt, output)]))
            self.refs[rid] = ref
        joined = {rid for rid, *_ in new}
        for rid in ids:
            if rid not in joined:
                self.refs[rid].update_state(None)

        try:
            self.proc.update_state(update)
        except Exception as exc:
            raise fail(f"update_state raised {type(exc).__name__}: {exc}") from exc
        if not ids:
            return
        logits = torch.randn(len(ids), self.vocab_size, generator=self.logits_gen)
        logits[torch.rand(logits.shape, generator=self.logits_gen) < 0.02] = float("-inf")
        given = logits.clone()
        try:
            out = self.proc.apply(logits)
        except Exception as exc:
            raise fail(f"apply raised {type(exc).__name__}: {exc}") from exc
        if out.shape != given.shape or out.dtype != given.dtype:
            raise fail(f"apply returned {tuple(out.shape)} {out.dtype}, expected {tuple(given.shape)} {given.dtype}")
        for row, rid in enumerate(ids):
            expected = self.refs[rid].apply(given[row : row + 1].clone())[0]
            same = _same(out[row], expected)
            if not bool(same.all()):
                toks = (~same).nonzero().flatten()[:4].tolist()
                raise fail(
                    f"differs from a batch-of-one reference at token ids {toks}: "
                    f"batched {out[row, toks].tolist()}, alone {expected[toks].tolist()}",
                    row,
                    rid,
                )
        for row in range(len(ids)):  # the step's sampled token, appended to the live lists
            self.batch.output_ids_of(row).append(self._token())


def check_processor(
    cls_or_factory: ProcessorFactory,
    *,
    steps: int = 1000,
    vocab_size: int = 64,
    seed: int = 0,
    make_params: ParamsFactory | None = None,
    config: object = None,
    max_num_reqs: int = 8,
) -> None:
    """Raise ConformanceFailure (an AssertionError) at the first step a row diverges.

    ``cls_or_factory`` is the processor class, or any callable ``(config, device,
    is_pin_memory) -> LogitsProcessor``. ``make_params(rng)`` builds each joining request's
    params (default: ``random_params`` over the built-ins); it must produce params the
    processor's ``validate_params`` accepts. The failure names the step, row, request id and
    the step's BatchUpdate. Runs on CPU, deterministic for a given ``seed``.
    """
    if make_params is None:
        make_params = lambda rng: random_params(rng, vocab_size)
    run = _Run(cls_or_factory, make_params, vocab_size=vocab_size, max_num_reqs=max_num_reqs, seed=seed, config=config)
    for step in range(steps):
        run.step(step)
