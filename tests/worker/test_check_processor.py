"""The conformance harness passes every shipped processor and catches broken ones."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.fixtures.seed_processors import DummyLogitsProcessor, RaisingLogitsProcessor, WrappedPerReqLogitsProcessor
from worker.logits_processor import BatchUpdate, MoveDirectionality
from worker.logits_processor.builtin import (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from worker.logits_processor.penalties import PenaltiesLogitsProcessor
from worker.sampling_params import SamplingParams
from worker.testing import ConformanceFailure, check_processor, describe_update, random_params

V = 64


def _target_params(rng: random.Random) -> SamplingParams:
    """Enable the seeds' processors on most requests (target 0 is falsy, so start at 1)."""
    return random_params(rng, V, extra_args={"target_token": rng.randrange(1, V)} if rng.random() < 0.7 else None)


@pytest.mark.parametrize(
    "cls",
    [
        AllowedTokenIdsLogitsProcessor,
        BadWordsLogitsProcessor,
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        PenaltiesLogitsProcessor,
    ],
)
def test_builtins_conform(cls: type) -> None:
    check_processor(cls, steps=1000, vocab_size=V)


@pytest.mark.parametrize("cls", [DummyLogitsProcessor, WrappedPerReqLogitsProcessor])
def test_seed_examples_conform(cls: type) -> None:
    check_processor(cls, steps=1000, vocab_size=V, make_params=_target_params)


# -- deliberately broken processors -------------------------------------------------------------


def _rewrite(bu: BatchUpdate | None, **changes: Any) -> BatchUpdate | None:
    if bu is None:
        return None
    fields = {"batch_size": bu.batch_size, "removed": bu.removed, "moved": bu.moved, "added": bu.added}
    return BatchUpdate(**{**fields, **changes})


class _SwapAsMove(DummyLogitsProcessor):
    """Bug: treats every SWAP as a one-way move (the row swapped out loses its state)."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        moved = [(s, d, MoveDirectionality.UNIDIRECTIONAL) for s, d, _ in (batch_update.moved if batch_update else ())]
        super().update_state(_rewrite(batch_update, moved=moved))


class _IgnoresRemoves(DummyLogitsProcessor):
    """Bug: never drops removed rows, so state lingers past the end of the batch."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        super().update_state(_rewrite(batch_update, removed=[]))


class _CouplesRows(DummyLogitsProcessor):
    """Bug: a row's result depends on the other rows (subtracts the batch-wide max)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = super().apply(logits)
        if self.req_info:
            logits -= logits[torch.isfinite(logits)].max()
        return logits


def test_ignoring_swaps_is_reported_at_the_first_diverging_step() -> None:
    with pytest.raises(ConformanceFailure) as info:
        check_processor(_SwapAsMove, make_params=_target_params)
    err = info.value
    assert err.batch_update is not None
    assert any(kind == MoveDirectionality.SWAP for *_, kind in err.batch_update.moved)
    assert err.row is not None and err.req_id is not None
    msg = str(err)
    assert msg.startswith(f"step {err.step}: row {err.row} (request {err.req_id!r}):")
    assert describe_update(err.batch_update).split("added=")[0] in msg
    # every step before it conforms: this really is the first divergence
    check_processor(_SwapAsMove, steps=err.step, make_params=_target_params)


def test_ignoring_removes_is_reported() -> None:
    with pytest.raises(ConformanceFailure) as info:
        check_processor(_IgnoresRemoves, make_params=_target_params)
    err = info.value
    assert err.batch_update is not None and list(err.batch_update.removed)
    assert f"step {err.step}:" in str(err) and "removed=[" in str(err)
    check_processor(_IgnoresRemoves, steps=err.step, make_params=_target_params)


def test_row_coupling_is_reported() -> None:
    with pytest.raises(ConformanceFailure, match="differs from a batch-of-one reference"):
        check_processor(_CouplesRows, make_params=_target_params)


def test_a_raising_processor_is_reported_with_its_phase() -> None:
    def make(rng: random.Random) -> SamplingParams:
        return SamplingParams(extra_args={"raise_in": "apply"} if rng.random() < 0.05 else None)

    with pytest.raises(ConformanceFailure, match=r"^step \d+: apply raised RuntimeError") as info:
        check_processor(RaisingLogitsProcessor, make_params=make)
    assert info.value.batch_update is not None and info.value.batch_update.added


def test_params_the_processor_rejects_fail_loudly() -> None:
    with pytest.raises(ValueError, match="target_token value x is not int"):
        check_processor(DummyLogitsProcessor, make_params=lambda rng: SamplingParams(extra_args={"target_token": "x"}))


def test_describe_update_names_added_requests_after_moves() -> None:
    bu = BatchUpdate(
        batch_size=3,
        removed=[2],
        moved=[(3, 2, MoveDirectionality.UNIDIRECTIONAL), (0, 1, MoveDirectionality.SWAP)],
        added=[(0, SamplingParams(), [], [])],
    )
    assert describe_update(bu, ["B", "E", "D"]) == (
        "BatchUpdate(batch_size=3, removed=[2], added=[0:E], moved=[3->2, 0<->1])"
    )
    assert describe_update(None) == "None"
