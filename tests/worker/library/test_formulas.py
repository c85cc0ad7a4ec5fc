"""Each library processor, batched, against the plain per-row reference of its published formula.

Rows that did not enable the processor (or enabled it with the "off" value) must come back
bit-identical; enabled rows must equal the reference row.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.library import references as ref
from tests.worker.library.batch import apply_once, random_logits
from worker.logits_processor.library import (
    DRYLogitsProcessor,
    EpsilonLogitsProcessor,
    EtaLogitsProcessor,
    NoRepeatNgramLogitsProcessor,
    TopALogitsProcessor,
    TypicalPLogitsProcessor,
)
from worker.sampling_params import SamplingParams

V = 48
SETTINGS = settings(max_examples=30, deadline=None)


def _params(extra: dict | None, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, extra_args=extra)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _check_simple(cls: type, key: str, reference, values: list[float | None], seed: int) -> None:
    """Rows enabled with ``values[i]`` (None = not enabled), compared row by row."""
    logits = random_logits(seed, len(values), V)
    params = [_params(None if v is None else {key: v}) for v in values]
    out = apply_once(cls, params, logits)
    for i, v in enumerate(values):
        _same(out[i], logits[i] if v is None else reference(logits[i], v))


cut = st.one_of(st.none(), st.floats(0.001, 0.2))


@SETTINGS
@given(st.lists(st.one_of(st.none(), st.floats(0.05, 1.0)), min_size=1, max_size=6), st.integers(0, 2**16))
def test_typical_p_matches_transformers(values: list[float | None], seed: int) -> None:
    """1.0 is the off value (as top_p's): the row comes back as it was. Transformers refuses a
    mass >= 1, and its formula there is no identity: in float32 the cumulative mass can reach 1.0
    before the last token, which it then removes (1 in 20 random rows; a hypothesis run that drew
    1.0 failed on it)."""
    _check_simple(
        TypicalPLogitsProcessor, "typical_p", lambda row, v: row if v >= 1.0 else ref.typical(row, v), values, seed
    )


@SETTINGS
@given(st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), min_size=1, max_size=6), st.integers(0, 2**16))
def test_top_a_matches_the_webui_rule(values: list[float | None], seed: int) -> None:
    _check_simple(TopALogitsProcessor, "top_a", ref.top_a, values, seed)


@SETTINGS
@given(st.lists(cut, min_size=1, max_size=6), st.integers(0, 2**16))
def test_epsilon_matches_transformers(values: list[float | None], seed: int) -> None:
    _check_simple(EpsilonLogitsProcessor, "epsilon_cutoff", ref.epsilon, values, seed)


@SETTINGS
@given(st.lists(cut, min_size=1, max_size=6), st.integers(0, 2**16))
def test_eta_matches_transformers(values: list[float | None], seed: int) -> None:
    _check_simple(EtaLogitsProcessor, "eta_cutoff", ref.eta, values, seed)


texts = st.lists(st.integers(0, 5), min_size=0, max_size=40)  # a small alphabet: many repeats


@SETTINGS
@given(st.lists(st.tuples(texts, texts, st.integers(0, 4)), min_size=1, max_size=5), st.integers(0, 2**16))
def test_no_repeat_ngram_matches_transformers(rows: list[tuple[list[int], list[int], int]], seed: int) -> None:
    logits = random_logits(seed, len(rows), V)
    params = [_params({"no_repeat_ngram_size": n}, temperature=0.0) for _, _, n in rows]  # greedy rows too
    out = apply_once(NoRepeatNgramLogitsProcessor, params, logits, [p for p, _, _ in rows], [o for _, o, _ in rows])
    for i, (prompt, output, n) in enumerate(rows):
        expected = logits[i].clone()
        if n:
            expected[ref.no_repeat_ngram_banned(prompt + output, n)] = float("-inf")
        _same(out[i], expected)


dry_args = st.fixed_dictionaries(
    {
        "dry_multiplier": st.sampled_from([0.0, 0.8, 2.0]),
        "dry_base": st.sampled_from([1.0, 1.75, 3.0]),
        "dry_allowed_length": st.integers(1, 4),
        "dry_penalty_last_n": st.sampled_from([-1, 0, 3, 10, 30]),
        "dry_sequence_breakers": st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=3),
    }
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(texts, texts, dry_args), min_size=1, max_size=5), st.integers(0, 2**16))
def test_dry_matches_llama_cpp(rows: list[tuple[list[int], list[int], dict]], seed: int) -> None:
    logits = random_logits(seed, len(rows), V)
    params = [_params(a) for _, _, a in rows]
    out = apply_once(DRYLogitsProcessor, params, logits, [p for p, _, _ in rows], [o for _, o, _ in rows])
    for i, (prompt, output, a) in enumerate(rows):
        expected = ref.dry(
            logits[i],
            prompt + output,
            a["dry_multiplier"],
            a["dry_base"],
            a["dry_allowed_length"],
            a["dry_penalty_last_n"],
            a["dry_sequence_breakers"],
        )
        _same(out[i], expected)


@settings(max_examples=25, deadline=None)
@given(texts, st.lists(st.integers(0, 5), min_size=1, max_size=30), dry_args, st.integers(0, 2**16))
def test_dry_stays_exact_as_the_output_grows(prompt: list[int], tokens: list[int], args: dict, seed: int) -> None:
    """The incremental suffix-match update equals llama.cpp's from-scratch count at every step."""
    from tests.worker.library.batch import CPU, add_all

    proc = DRYLogitsProcessor(None, CPU, False)
    output: list[int] = []
    add_all(proc, [_params(args)], [prompt], [output])
    for step, tok in enumerate(tokens):
        logits = random_logits(seed + step, 1, V)
        got = proc.apply(logits.clone())
        expected = ref.dry(
            logits[0],
            prompt + output,
            args["dry_multiplier"],
            args["dry_base"],
            args["dry_allowed_length"],
            args["dry_penalty_last_n"],
            args["dry_sequence_breakers"],
        )
        _same(got[0], expected)
        proc.update_state(None)
        output.append(tok)
