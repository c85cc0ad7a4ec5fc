"""Delta outputs: merging consecutive deltas (a fresh accumulator per window, as a coalescing
stream does) loses nothing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.outputs import CompletionOutput, Logprob, OutputAccumulator, RequestOutput


@st.composite
def delta_streams(draw):
    n = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 8))
    deltas = []
    for step in range(steps):
        last = step == steps - 1
        outs = []
        for i in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)) if not last else range(n):
            toks = draw(st.lists(st.integers(0, 50), max_size=3))
            outs.append(
                CompletionOutput(
                    i,
                    draw(st.text(max_size=4)),
                    toks,
                    float(-step),
                    [{t: Logprob(-1.0, 1)} for t in toks],
                    "length" if last else None,
                    queue_time_s=draw(st.floats(0, 9)) if last else None,  # the engine sets it last only
                )
            )
        deltas.append(RequestOutput("r", "p", [1, 2], outs, last))
    return deltas


@given(delta_streams(), st.data())
def test_merging_any_consecutive_deltas_accumulates_the_same(deltas, data):
    ref = OutputAccumulator()
    for d in deltas:
        want = ref.add(d)
    # merge into random consecutive groups, then accumulate the groups
    merged, window = [], OutputAccumulator()
    for d in deltas:
        pending = window.add(d)
        if data.draw(st.booleans()) or d.finished:
            merged.append(pending)
            window = OutputAccumulator()
    acc = OutputAccumulator()
    for m in merged:
        got = acc.add(m)
    assert got.finished and want.finished
    fields = ("index", "text", "token_ids", "logprobs", "finish_reason", "cumulative_logprob", "queue_time_s")
    assert [[getattr(c, f) for f in fields] for c in got.outputs] == [
        [getattr(c, f) for f in fields] for c in want.outputs
    ]
    assert all(c.queue_time_s == d.queue_time_s for c, d in zip(got.outputs, deltas[-1].outputs))
