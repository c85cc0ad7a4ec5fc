"""StructuredCompiler's cache is bounded in bytes as well as in entries.

One within-bound JSON schema can compile to tens of MiB (the soak's heavy schema: ~10 MiB a
property), so a cache bounded only by its 256 entries let distinct schemas pin gigabytes in the
ingress and in every worker. Checked against a plain LRU over xgrammar's own size figures.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.logits_processor.structured_grammar import StructuredCompiler
from worker.structured_outputs import StructuredOutputsParams

VOCAB = ["<eos>", "a", "b", "c", "x", "y", "1", "2"]
# Distinct constraints of different compiled sizes (a repetition bound is unrolled).
SPECS = [f"a{{1,{n}}}b" for n in (1, 4, 16, 32, 64)] + ["(ab)*c", "x|y", "[abc]{1,24}"]


def _compiler(**kw) -> StructuredCompiler:
    return StructuredCompiler.from_vocab(VOCAB, [0], **kw)


@pytest.fixture(scope="module")
def sizes() -> dict[str, int]:
    c = _compiler()
    return {spec: c.compile(StructuredOutputsParams(regex=spec)).nbytes for spec in SPECS}


def test_sizes_differ_and_come_from_xgrammar(sizes):
    assert len(set(sizes.values())) >= 4, sizes
    assert sizes["a{1,64}b"] > sizes["a{1,1}b"]


@settings(max_examples=30)
@given(
    data=st.data(),
    order=st.lists(st.sampled_from(SPECS), min_size=1, max_size=14),
    cache_size=st.integers(1, 6),
)
def test_cache_matches_a_byte_bounded_lru(sizes, data, order, cache_size):
    budget = data.draw(st.integers(min(sizes.values()) - 1, sum(sizes.values())), label="cache_bytes")
    c = _compiler(cache_size=cache_size, cache_bytes=budget)
    ref: OrderedDict[str, int] = OrderedDict()
    for spec in order:
        got = c.compile(StructuredOutputsParams(regex=spec))
        assert got.nbytes == sizes[spec]
        if spec in ref:
            ref.move_to_end(spec)
        elif sizes[spec] <= budget:  # larger than the whole budget: served, never kept
            ref[spec] = sizes[spec]
            while len(ref) > cache_size or sum(ref.values()) > budget:
                ref.popitem(last=False)
        assert [k for _, k in c._cache] == list(ref), (budget, cache_size)
        assert c.cached_bytes == sum(ref.values()) <= budget
    c.clear()
    assert c.cached_bytes == 0 and len(c) == 0


def test_a_grammar_over_the_whole_budget_is_served_not_kept(sizes):
    big = "a{1,64}b"
    c = _compiler(cache_bytes=sizes[big] - 1)
    for _ in range(2):
        compiled = c.compile(StructuredOutputsParams(regex=big))
        assert compiled.matcher() is not None
    assert len(c) == 0 and c.cached_bytes == 0
    assert c.misses == 2  # compiled each time: nothing kept
