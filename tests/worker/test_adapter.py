"""AdapterLogitsProcessor: request-level callables run on exactly the rows that enabled them."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from tests.fixtures.seed_processors import WrappedPerReqLogitsProcessor
from worker.batch import PersistentBatch
from worker.logits_processor import AdapterLogitsProcessor, RequestLogitsProcessor
from worker.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 16


def _req(rid: str, extra: dict[str, Any] | None = None, prompt: list[int] | None = None) -> tuple:
    return (rid, SamplingParams(extra_args=extra), prompt if prompt is not None else [], [])


def test_wrapped_seed_masks_only_enabled_rows_and_follows_moves() -> None:
    proc = WrappedPerReqLogitsProcessor(None, CPU, False)
    batch = PersistentBatch(4)
    proc.update_state(batch.update([], [_req("a", {"target_token": 3}), _req("b"), _req("c", {"target_token": 9})]))
    logits = torch.randn(3, V)
    out = proc.apply(logits.clone())
    for row, target in ((0, 3), (2, 9)):
        assert out[row, target] == logits[row, target]
        assert torch.isinf(out[row]).sum() == V - 1
    assert torch.equal(out[1], logits[1])

    # a finishes: c condenses into row 0 and keeps its target; b untouched.
    proc.update_state(batch.update(["a"], [], swaps=[(0, 1)]))
    assert batch.req_ids == ["b", "c"]
    logits = torch.randn(2, V)
    out = proc.apply(logits.clone())
    assert torch.equal(out[0], logits[0])
    assert out[1, 9] == logits[1, 9] and torch.isinf(out[1]).sum() == V - 1


def test_no_enabled_rows_returns_the_input_untouched() -> None:
    proc = WrappedPerReqLogitsProcessor(None, CPU, False)
    batch = PersistentBatch(2)
    proc.update_state(batch.update([], [_req("a"), _req("b")]))
    logits = torch.randn(2, V)
    assert torch.equal(proc.apply(logits.clone()), logits)


class _BanLastOutput:
    """2-arg form: bans the request's most recent output token (reads the live list)."""

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if output_ids:
            logits[output_ids[-1]] = float("-inf")
        return logits


def _ban_prompt(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """3-arg form: bans every prompt token, and returns a new tensor rather than the view."""
    out = logits.clone()
    out[prompt_ids] = float("-inf")
    return out


class _Adapter(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        kind = (params.extra_args or {}).get("kind")
        return {"two": _BanLastOutput(), "three": _ban_prompt, "bad": lambda logits: logits}.get(kind)


def test_two_and_three_argument_callables() -> None:
    proc = _Adapter(None, CPU, False)
    batch = PersistentBatch(4)
    new = [_req("two", {"kind": "two"}), _req("three", {"kind": "three"}, prompt=[1, 4]), _req("off")]
    outs = {rid: out for rid, _, _, out in new}
    proc.update_state(batch.update([], new))

    logits = torch.zeros(3, V)
    out = proc.apply(logits.clone())
    assert torch.equal(out[0], logits[0])  # nothing generated yet
    assert torch.isinf(out[1]).nonzero().flatten().tolist() == [1, 4]
    assert torch.equal(out[2], logits[2])

    outs["two"].append(7)  # the engine appends; the processor is not told
    proc.update_state(None)
    out = proc.apply(torch.zeros(3, V))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [7]
    assert torch.isinf(out[1]).nonzero().flatten().tolist() == [1, 4]
    assert not torch.isinf(out[2]).any()


def test_wrong_arity_is_rejected_when_the_request_is_added() -> None:
    proc = _Adapter(None, CPU, False)
    with pytest.raises(TypeError, match="must take \\(output_ids, logits\\)"):
        proc.update_state(PersistentBatch(1).update([], [_req("x", {"kind": "bad"})]))


class _CountingCallable:
    """Counts how often its signature is inspected (inspect.signature reads __signature__)."""

    inspections = 0

    @property
    def __signature__(self) -> inspect.Signature:
        type(self).inspections += 1
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return inspect.Signature([inspect.Parameter("output_ids", kind), inspect.Parameter("logits", kind)])

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[0] += 1.0
        return logits


class _CountingAdapter(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        return _CountingCallable()


def test_arity_is_inspected_once_per_request_not_per_call() -> None:
    _CountingCallable.inspections = 0
    proc = _CountingAdapter(None, CPU, False)
    batch = PersistentBatch(4)
    proc.update_state(batch.update([], [_req("a"), _req("b")]))
    assert _CountingCallable.inspections == 2
    for _ in range(5):
        proc.update_state(batch.update([], [], swaps=[(0, 1)]))
        out = proc.apply(torch.zeros(2, V))
        assert out[:, 0].tolist() == [1.0, 1.0]
    assert _CountingCallable.inspections == 2
