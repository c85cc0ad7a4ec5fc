"""PersistentBatch: docs/sampling.md "Row layout"'s worked examples, errors, columns, metadata, and a stateful model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from worker.batch import PersistentBatch
from worker.logits_processor import BatchUpdate, MoveDirectionality
from worker.sampling_params import SamplingParams

U, S = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP


def _req(rid: str, **kw: object) -> tuple[str, SamplingParams, list[int], list[int]]:
    return (rid, SamplingParams(**kw), [1, 2], [])  # type: ignore[arg-type]  # kw: SamplingParams' own fields


def _batch_of(ids: str, max_num_reqs: int = 8) -> PersistentBatch:
    b = PersistentBatch(max_num_reqs)
    b.update([], [_req(r) for r in ids])
    return b


# -- docs/sampling.md "Row layout" worked examples -----------------------------------------------------------------


def test_worked_example_fewer_new_than_finished() -> None:
    b = _batch_of("ABCD")
    e = _req("E")
    up = b.update(["A", "C"], [e], swaps=[(0, 1)])
    assert up is not None
    assert [(i, p, pr, out) for i, p, pr, out in up.added] == [(0, e[1], e[2], e[3])]
    assert up.added[0][1] is e[1] and up.added[0][3] is e[3]
    assert list(up.removed) == [2]
    assert list(up.moved) == [(3, 2, U), (0, 1, S)]
    assert up.batch_size == 3
    assert b.req_ids == ["B", "E", "D"]


def test_worked_example_more_new_than_finished() -> None:
    b = _batch_of("ABCD")
    e, f = _req("E"), _req("F")
    up = b.update(["C"], [e, f], swaps=[(0, 1)])
    assert up is not None
    assert [i for i, *_ in up.added] == [2, 4]
    assert up.added[0][1] is e[1] and up.added[1][1] is f[1]
    assert list(up.removed) == []
    assert list(up.moved) == [(0, 1, S)]
    assert up.batch_size == 5
    assert b.req_ids == ["B", "A", "E", "D", "F"]


def test_condense_fills_lowest_hole_from_highest_row() -> None:
    b = _batch_of("ABCDEF")
    up = b.update(["A", "C", "F"], [])
    assert up is not None
    # F's row is the tail (no move); holes 0 and 2 take E then D.
    assert list(up.removed) == [0, 2, 5]
    assert list(up.moved) == [(4, 0, U), (3, 2, U)]
    assert up.batch_size == 3 and b.req_ids == ["E", "B", "D"]


def test_live_output_list_is_kept_not_copied() -> None:
    b = PersistentBatch(4)
    out: list[int] = []
    up = b.update([], [("A", SamplingParams(), [5], out)])
    assert up is not None and up.added[0][3] is out
    assert b.output_ids_of(0) is out
    b.update([], [_req("B")], swaps=[(0, 1)])
    out.append(7)
    assert b.output_ids_of(b.index_of("A")) == [7]


def test_nothing_changed_returns_none_and_keeps_metadata() -> None:
    b = _batch_of("AB")
    md = b.sampling_metadata()
    assert b.update([], []) is None
    assert b.sampling_metadata() is md
    b.update(["A"], [])
    assert b.sampling_metadata() is not md
    assert b.sampling_metadata().batch_size == 1


def test_swaps_callable_sees_the_order_after_condense() -> None:
    b = _batch_of("ABCD")
    seen: list[list[str]] = []

    def policy(order: list[str]) -> list[tuple[int, int]]:
        seen.append(order)
        return [(0, 2)]

    up = b.update(["B"], [], swaps=policy)
    assert seen == [["A", "D", "C"]]
    assert up is not None and list(up.moved) == [(3, 1, U), (0, 2, S)]
    assert b.req_ids == ["C", "D", "A"]


@pytest.mark.parametrize(
    ("finished", "new", "swaps", "match"),
    [
        (["Z"], [], [], "finished: request 'Z' is not in the batch"),
        (["A", "A"], [], [], "finished: a request is listed twice"),
        ([], ["B"], [], "new: request 'B' is already in the batch"),
        ([], ["X", "X"], [], "new: request 'X' is already in the batch"),
        ([], ["X", "Y", "Z"], [], "exceed max_num_reqs=4"),
        ([], [], [(0, 2)], r"swaps: \(0, 2\) must name two different rows of a batch of 2"),
        ([], [], [(-1, 0)], r"swaps: \(-1, 0\)"),
        ([], [], [(1, 1)], r"swaps: \(1, 1\)"),
        (["A"], ["X"], [(0, 2)], r"swaps: \(0, 2\)"),
    ],
)
def test_invalid_updates_raise_and_leave_the_batch_intact(
    finished: list[str], new: list[str], swaps: list[tuple[int, int]], match: str
) -> None:
    b = _batch_of("AB", max_num_reqs=4)
    md = b.sampling_metadata()
    with pytest.raises(ValueError, match=match):
        b.update(finished, [_req(r) for r in new], swaps)
    assert b.req_ids == ["A", "B"] and b.num_reqs == 2
    assert b.index_of("A") == 0 and b.sampling_metadata() is md
    with pytest.raises(KeyError):
        b.index_of("X")


# -- columns and metadata ----------------------------------------------------------------------


def test_columns_normalise_off_values_and_greedy_rows() -> None:
    b = PersistentBatch(4)
    b.update(
        [],
        [
            _req("greedy", temperature=0.0, top_k=5, top_p=0.5, logprobs=3),
            _req("off", temperature=0.7, top_k=-1),
            _req("on", temperature=1.3, top_k=7, top_p=0.9, repetition_penalty=1.2),
        ],
    )
    assert b.column("top_k").tolist() == [0, 0, 7]
    assert b.column("top_p").tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert b.column("greedy").tolist() == [True, False, False]
    assert b.column("num_logprobs").tolist() == [3, -1, -1]
    assert b.column("uses_penalties").tolist() == [False, False, True]
    md = b.sampling_metadata()
    assert md.temperature.dtype == torch.float32 and md.temperature.tolist() == pytest.approx([0.0, 0.7, 1.3])
    assert md.greedy_mask.tolist() == [True, False, False]
    assert not md.all_greedy and not md.all_random
    assert md.top_k is not None and md.top_k.tolist() == [0, 0, 7]
    assert md.top_p is not None
    assert md.max_num_logprobs == 3 and md.num_logprobs is not None and md.num_logprobs.tolist() == [3, -1, -1]
    assert md.no_penalties is False
    assert md.logprobs_modes == ("raw_logprobs",) * 3


def test_greedy_follows_params_not_float32_temperature() -> None:
    # float32(1e-5) < 1e-5, but the request is not greedy (temperature < 1e-5 is false).
    b = PersistentBatch(2)
    b.update([], [_req("edge", temperature=1e-5, top_k=3)])
    assert b.sampling_metadata().greedy_mask.tolist() == [False]
    assert b.column("top_k").tolist() == [3]


def test_metadata_off_features_are_none() -> None:
    b = PersistentBatch(4)
    b.update([], [_req("a", temperature=0.0), _req("b", temperature=0.0, logprobs_mode="raw_logits")])
    md = b.sampling_metadata()
    assert md.all_greedy and not md.all_random
    assert md.top_k is None and md.top_p is None
    assert md.num_logprobs is None and md.max_num_logprobs is None
    assert md.no_penalties and md.generators == {}
    assert md.logprobs_modes == ("raw_logprobs", "raw_logits")


def test_metadata_does_not_alias_the_columns() -> None:
    b = PersistentBatch(4)
    b.update([], [_req("a", temperature=0.5), _req("b", temperature=1.5)])
    md = b.sampling_metadata()
    b.update(["a"], [_req("c", temperature=0.1)])
    assert md.temperature.tolist() == pytest.approx([0.5, 1.5])
    assert b.sampling_metadata().temperature.tolist() == pytest.approx([0.1, 1.5])


def test_seeded_rows_get_their_own_generator_that_moves_with_them() -> None:
    b = PersistentBatch(4)
    b.update([], [_req("a"), _req("s", seed=1234)])
    gen = b.generator_of(1)
    assert b.generator_of(0) is None and gen is not None
    expected = torch.rand(4, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(torch.rand(4, generator=gen), expected)
    b.update([], [], swaps=[(0, 1)])
    assert b.generator_of(0) is gen
    assert b.sampling_metadata().generators == {0: gen}


def test_empty_slots_are_reset_to_defaults() -> None:
    b = PersistentBatch(3)
    b.update([], [_req("a"), _req("b", temperature=0.0, logprobs=2, top_k=4)])
    b.update(["b"], [])
    b.update([], [_req("c")])
    assert b.column("num_logprobs").tolist() == [-1, -1]
    assert b.column("greedy").tolist() == [False, False]


# -- a stateful model ----------------------------------------------------------------------------

_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-5, 0.5, 1.0, 2.0]),
    top_k=st.sampled_from([0, -1, 1, 5]),
    top_p=st.sampled_from([1.0, 0.5]),
    logprobs=st.sampled_from([None, 0, 3]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    presence_penalty=st.sampled_from([0.0, -0.5]),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    logprobs_mode=st.sampled_from(["raw_logprobs", "processed_logits"]),
)


def _expected_columns(p: SamplingParams) -> dict[str, float | int | bool]:
    greedy = p.temperature < 1e-5
    return {
        "temperature": float(torch.tensor(p.temperature, dtype=torch.float32)),
        "greedy": greedy,
        "top_k": 0 if greedy or p.top_k in (0, -1) else p.top_k,
        "top_p": 1.0 if greedy else float(torch.tensor(p.top_p, dtype=torch.float32)),
        "num_logprobs": -1 if p.logprobs is None else p.logprobs,
        "uses_penalties": p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0,
    }


def _model_update(order: list[str], finished: list[str], new: list[str], swaps: list[tuple[int, int]]) -> list[str]:
    """docs/sampling.md "Row layout" on a plain list, written independently of the implementation."""
    slots: list[str | None] = list(order)
    holes = sorted(slots.index(r) for r in finished)
    for k, rid in enumerate(new):
        if k < len(holes):
            slots[holes[k]] = rid
        else:
            slots.append(rid)
    for h in holes[len(new) :]:
        slots[h] = None
    while True:
        while slots and slots[-1] is None:
            slots.pop()
        if None not in slots:
            break
        slots[slots.index(None)] = slots.pop()
    for i, j in swaps:
        slots[i], slots[j] = slots[j], slots[i]
    return [s for s in slots if s is not None]


def _replay(prev: list[str], up: BatchUpdate, ids_by_params: dict[int, str]) -> list[str]:
    """Apply a BatchUpdate to a plain list: removes, then adds, then moves in order."""
    slots: list[str | None] = list(prev) + [None] * 16
    for i in up.removed:
        slots[i] = None
    for i, params, _, _ in up.added:
        slots[i] = ids_by_params[id(params)]
    for src, dst, kind in up.moved:
        if kind == MoveDirectionality.SWAP:
            slots[src], slots[dst] = slots[dst], slots[src]
        else:
            slots[dst], slots[src] = slots[src], None
    assert all(s is not None for s in slots[: up.batch_size])
    assert all(s is None for s in slots[up.batch_size :])
    return [s for s in slots[: up.batch_size] if s is not None]


class BatchMachine(RuleBasedStateMachine):
    MAX = 6

    def __init__(self) -> None:
        super().__init__()
        self.batch = PersistentBatch(self.MAX)
        self.order: list[str] = []
        self.params: dict[str, SamplingParams] = {}
        self.gens: dict[str, torch.Generator | None] = {}
        self.outputs: dict[str, list[int]] = {}
        self.next_id = 0

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        finished = data.draw(st.lists(st.sampled_from(self.order), unique=True) if self.order else st.just([]))
        room = self.MAX - len(self.order) + len(finished)
        new_params = data.draw(st.lists(_params, max_size=min(room, 4)))
        size = len(self.order) - len(finished) + len(new_params)
        pair = st.tuples(st.integers(0, size - 1), st.integers(0, size - 1)).filter(lambda t: t[0] != t[1])
        swaps = data.draw(st.lists(pair, max_size=3)) if size >= 2 else []
        new = []
        for p in new_params:
            rid = f"r{self.next_id}"
            self.next_id += 1
            new.append((rid, p, [self.next_id], []))
        prev = list(self.order)

        up = self.batch.update(finished, new, swaps)

        self.order = _model_update(prev, finished, [r for r, *_ in new], swaps)
        for rid in finished:
            del self.params[rid], self.gens[rid], self.outputs[rid]
        for rid, p, _, out in new:
            self.params[rid] = p
            self.outputs[rid] = out
            gen = self.batch.generator_of(self.batch.index_of(rid))
            assert (gen is None) == (p.seed is None)
            self.gens[rid] = gen
        if not (finished or new or swaps):
            assert up is None
            return
        assert up is not None
        assert up.batch_size == len(self.order)
        assert _replay(prev, up, {id(p): rid for rid, p, *_ in new}) == self.order
        for rid in list(self.outputs)[:2]:  # live lists keep growing without notification
            self.outputs[rid].append(len(self.outputs[rid]))

    @invariant()
    def rows_match_the_model(self) -> None:
        b = self.batch
        assert b.req_ids == self.order and b.num_reqs == len(self.order)
        md = b.sampling_metadata()
        assert md.batch_size == len(self.order)
        for row, rid in enumerate(self.order):
            assert b.index_of(rid) == row
            assert b.params_of(row) is self.params[rid]
            assert b.output_ids_of(row) is self.outputs[rid]
            assert b.generator_of(row) is self.gens[rid]
            for name, value in _expected_columns(self.params[rid]).items():
                got = b.column(name)[row].item()
                assert got == value if not isinstance(value, float) else math.isclose(got, value), (name, rid)
        assert md.generators == {r: g for r, g in enumerate(self.gens[x] for x in self.order) if g is not None}
        assert md.greedy_mask.tolist() == [self.params[r].is_greedy for r in self.order]
        assert md.logprobs_modes == tuple(self.params[r].logprobs_mode for r in self.order)


BatchMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_batch_against_a_plain_list_model = BatchMachine.TestCase
