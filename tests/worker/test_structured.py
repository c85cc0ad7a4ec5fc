"""StructuredOutputsLogitsProcessor, its grammar adapter and StructuredOutputsParams, without a model run."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.logits_processor import BatchUpdate
from worker.logits_processor.registry import BUILTIN_PROCESSORS
from worker.logits_processor.structured import (
    StructuredOutputsLogitsProcessor,
    apply_token_bitmask_,
    unpack_bitmask,
)
from worker.logits_processor.structured_grammar import StructuredCompiler
from worker.sampling_params import SamplingParams
from worker.structured_outputs import StructuredOutputsParams
from worker.testing import CharTokenizer, check_processor, random_params

V = 64
EOS = V - 1

# A 64-token vocabulary whose tokens the harness draws often (CharTokenizer's ids of "abcde")
# are the letters the constraints below are made of, so rows live for many steps.
_HOT = {CharTokenizer(V).encode(ch)[0]: ch for ch in "abcde"}
_FILL = [*list('{}[]":, 0123456789xyzfghijklmnopqrstuvw'), "ab", "cd", "true", "false", "null", '{"', '":', '"}']


def _vocab() -> list[str]:
    fill = iter(_FILL * 3)
    return [_HOT.get(i) or ("" if i == EOS else next(fill)) for i in range(V)]


VOCAB = _vocab()
CONSTRAINTS = [
    {"regex": "[a-e]{0,12}"},
    {"regex": "(ab|cd)*e?"},
    {"choice": ["abc", "bad", "e", "dead"]},
    {"json_object": True},
    {"json": {"type": "object", "properties": {"a": {"enum": ["b", "c"]}}, "required": ["a"]}},
    {"grammar": 'root ::= ("a" | "b" | "cd")+ "e"'},
    {"grammar": 'start: ("a" | "b")+ "c"'},  # Lark
]


@pytest.fixture(scope="module")
def compiler() -> StructuredCompiler:
    return StructuredCompiler.from_vocab(VOCAB, [EOS])


def _constrained(so: dict, compiler: StructuredCompiler, **kw: object) -> SamplingParams:
    params = SamplingParams(structured_outputs=dict(so), **kw)  # type: ignore[arg-type]  # a dict, as a request gives it
    params.structured_outputs.compiled = compiler.compile(params.structured_outputs)  # type: ignore[union-attr]  # set on the line above
    return params


def _allowed(proc: StructuredOutputsLogitsProcessor, rows: int) -> list[set[int]]:
    out = proc.apply(torch.zeros(rows, V))
    return [set(torch.isfinite(out[r]).nonzero().flatten().tolist()) for r in range(rows)]


def _add(proc: StructuredOutputsLogitsProcessor, *params: SamplingParams) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in params]
    proc.update_state(BatchUpdate(len(params), [], [], [(i, p, [], outputs[i]) for i, p in enumerate(params)]))
    return outputs


def test_registered_as_builtin_and_not_argmax_invariant() -> None:
    assert StructuredOutputsLogitsProcessor in BUILTIN_PROCESSORS
    assert not StructuredOutputsLogitsProcessor(None, torch.device("cpu"), False).is_argmax_invariant()


def test_conforms_under_churn_with_random_constraints(compiler: StructuredCompiler) -> None:
    """Adds, removes, condense moves and swaps carry each row's matcher (check_processor)."""

    def make(rng: random.Random) -> SamplingParams:
        params = random_params(rng, V)
        if rng.random() < 0.75:
            so = StructuredOutputsParams.from_dict(dict(rng.choice(CONSTRAINTS)))
            so.compiled = compiler.compile(so)
            params = dataclasses.replace(params, structured_outputs=so)
        return params

    check_processor(StructuredOutputsLogitsProcessor, steps=600, vocab_size=V, make_params=make, seed=3)


def test_mask_follows_the_live_output_and_eos_only_where_accepted(compiler: StructuredCompiler) -> None:
    a, b, _c, d, _e = (CharTokenizer(V).encode(ch)[0] for ch in "abcde")
    proc = StructuredOutputsLogitsProcessor(None, torch.device("cpu"), False)
    free = SamplingParams()
    (out0, _) = _add(proc, _constrained({"choice": ["abc", "bad"]}, compiler), free)
    first, unconstrained = _allowed(proc, 2)
    assert unconstrained == set(range(V))  # a row without a constraint is untouched
    assert first == {a, b, VOCAB.index("ab")}  # prefixes of "abc" / "bad"; no EOS yet
    out0.append(b)  # the engine appends the sampled token; no notification
    proc.update_state(None)
    assert _allowed(proc, 2)[0] == {a}
    out0.extend([a, d])
    assert _allowed(proc, 2)[0] == {EOS}  # complete: only EOS


def test_rejected_token_kills_only_its_row(compiler: StructuredCompiler) -> None:
    proc = StructuredOutputsLogitsProcessor(None, torch.device("cpu"), False)
    out0, _out1 = _add(proc, _constrained({"regex": "[a-e]+"}, compiler), _constrained({"regex": "[a-e]+"}, compiler))
    out0.append(VOCAB.index("{"))  # only possible when something bypassed the mask
    dead, alive = _allowed(proc, 2)
    assert dead == set()
    assert alive == {t for t, text in enumerate(VOCAB) if text and set(text) <= set("abcde")}


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_apply_token_bitmask_matches_a_per_token_reference(rows: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    logits = torch.randn(rows, vocab, generator=g)
    expected = logits.clone()
    for r in range(rows):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    assert torch.equal(apply_token_bitmask_(logits, bitmask), expected)
    assert torch.equal(unpack_bitmask(bitmask, vocab), torch.isfinite(expected))


# -- compiling ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("so", "field", "needle"),
    [
        ({"json": {"type": "objekt"}}, "structured_outputs.json", "objekt"),
        ({"regex": "[a-"}, "structured_outputs.regex", "Unclosed"),
        ({"grammar": "root ::= foo"}, "structured_outputs.grammar", '"foo" is not defined'),
        ({"grammar": "root ::= [0-9]{3,1}"}, "structured_outputs.grammar", "Lower bound"),
    ],
)
def test_invalid_constraint_names_field_and_compiler_message(
    compiler: StructuredCompiler, so: dict, field: str, needle: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}: invalid") as info:
        compiler.compile(StructuredOutputsParams.from_dict(so))
    assert needle in str(info.value) and "/project/" not in str(info.value)


# Impossible combinations (issue 17, item 11): each a ValueError naming the field (a 400), never a
# request that fails in generation.
IMPOSSIBLE = [
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}},
    {"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2},
    {"type": "integer", "minimum": 5, "maximum": 2},
    {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1},
    {"type": "integer", "minimum": 1, "maximum": 2, "multipleOf": 3},
    {"type": "object", "minProperties": 5, "maxProperties": 2},
    {"type": "object", "properties": {"a": {}}, "required": ["a"], "maxProperties": 0},
    {"enum": []},
    {"type": "string", "pattern": "a{5,2}"},
]


@pytest.mark.parametrize("schema", IMPOSSIBLE, ids=lambda s: json.dumps(s)[:40])
@pytest.mark.parametrize("source", ["structured_outputs", "response_format.json_schema.schema"])
def test_impossible_schema_is_a_value_error_naming_the_field(
    compiler: StructuredCompiler, schema: dict, source: str
) -> None:
    field = "structured_outputs.json" if source == "structured_outputs" else source
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: invalid JSON schema: "):
        compiler.compile(StructuredOutputsParams(json=schema, source=source))


@pytest.fixture(scope="module")
def byte_compiler() -> StructuredCompiler:
    """A byte-level vocabulary (every byte its own token), where unsatisfiability can be proven."""
    return StructuredCompiler.from_vocab([bytes([b]) for b in range(256)] + [b""], [256])


@pytest.mark.parametrize(
    ("so", "satisfiable"),
    [
        ({"json": {"type": "string", "pattern": "^\n$"}}, False),  # JSON strings never hold a raw newline
        (
            {
                "json": {
                    "type": "object",
                    "properties": {"a": {"type": "string", "pattern": r"^[\x00-\x08]+$"}},
                    "required": ["a"],
                    "additionalProperties": False,
                }
            },
            False,
        ),
        ({"json": {"type": "string", "pattern": "^(a|\n)$"}}, True),  # one way out is enough
        ({"regex": "a\n"}, True),  # a regex is not JSON: a raw newline is output like any byte
        ({"json": {"const": "\n"}}, True),  # escaped by the JSON grammar
        ({"grammar": 'root ::= "x" ("y" | "z")*'}, True),
    ],
)
def test_a_constraint_no_output_satisfies_is_a_value_error(
    byte_compiler: StructuredCompiler, so: dict, satisfiable: bool
) -> None:
    params = StructuredOutputsParams(**so)
    if satisfiable:
        assert byte_compiler.compile(params) is not None
    else:
        with pytest.raises(
            ValueError, match=f"^structured_outputs.{params.kind}: invalid JSON schema: no output satisfies it"
        ):
            byte_compiler.compile(params)


def test_admits_nothing_is_a_proof_or_false() -> None:
    """A language with no end (``b ::= "c" b``) is not provable in a bounded search: not rejected."""
    c = StructuredCompiler.from_vocab([bytes([b]) for b in range(256)] + [b""], [256])
    assert c.compile(StructuredOutputsParams(grammar='root ::= "a" b\nb ::= "c" b')) is not None


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": [1]}, "structured_outputs.json"),
        ({"whitespace_pattern": " "}, "whitespace_pattern not supported"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
    ],
)
def test_shape_errors_before_any_compile(value: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(structured_outputs=value)  # type: ignore[arg-type]  # a malformed dict is the test


def test_cache_is_lru_keyed_by_constraint() -> None:
    c = StructuredCompiler.from_vocab(VOCAB, [EOS], cache_size=2)
    one = c.compile(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    # the same schema as a string (other spacing) is the same constraint
    assert c.compile(StructuredOutputsParams(json='{"type": "object",  "required": ["a"]}')) is one
    assert c.hits == 1
    c.compile(StructuredOutputsParams(regex="a+"))
    c.compile(StructuredOutputsParams(regex="b+"))  # evicts the least recently used (the schema)
    assert len(c) == 2
    assert c.compile(StructuredOutputsParams(json={"type": "object", "required": ["a"]})) is not one


def test_slow_compile_is_bounded() -> None:
    c = StructuredCompiler.from_vocab(VOCAB, [EOS], timeout_s=1e-4)
    schema = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "pattern": f"^[a-e]{{1,{i + 1}}}$"} for i in range(40)},
    }
    with pytest.raises(ValueError, match=r"^structured_outputs.json: compiling the JSON schema took longer than"):
        c.compile(StructuredOutputsParams(json=schema))


def test_compiled_grammar_never_pickled(compiler: StructuredCompiler) -> None:
    params = _constrained({"regex": "a+"}, compiler)
    back = pickle.loads(pickle.dumps(params))
    assert back.structured_outputs.compiled is None and back.structured_outputs == params.structured_outputs
    assert params.structured_outputs.compiled is not None


def test_uncompiled_params_are_refused_by_the_processor() -> None:
    proc = StructuredOutputsLogitsProcessor(None, torch.device("cpu"), False)
    with pytest.raises(ValueError, match="not compiled"):
        _add(proc, SamplingParams(structured_outputs={"regex": "a"}))  # type: ignore[arg-type]  # a dict, as a request gives it


def test_choice_escapes_quotes_and_backslashes(compiler: StructuredCompiler) -> None:
    so = StructuredOutputsParams(choice=['a"b', "c\\d", "e"])
    json.dumps(so.spec)
    assert compiler.compile(so) is not None


def test_harness_catches_a_matcher_left_behind_by_a_swap(compiler: StructuredCompiler) -> None:
    """The churn test above can fail: a processor that ignores swaps is caught."""
    from worker.logits_processor import MoveDirectionality
    from worker.testing import ConformanceFailure

    class IgnoresSwaps(StructuredOutputsLogitsProcessor):
        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is not None:
                moved = [m for m in batch_update.moved if m[2] != MoveDirectionality.SWAP]
                batch_update = BatchUpdate(batch_update.batch_size, batch_update.removed, moved, batch_update.added)
            super().update_state(batch_update)

    def make(rng: random.Random) -> SamplingParams:
        return _constrained(rng.choice(CONSTRAINTS), compiler)

    with pytest.raises(ConformanceFailure):
        check_processor(IgnoresSwaps, steps=600, vocab_size=V, make_params=make, seed=3)


@pytest.mark.parametrize("name", ["guided_choice", "tools[f].function.parameters"])
def test_shape_errors_name_the_field_the_constraint_came_from(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: must be a non-empty list"):
        StructuredOutputsParams.from_dict({"choice": ["a", ""]}, name=name)


@settings(max_examples=200, deadline=None)
@given(
    vocab_size=st.integers(1, 300),
    ids=st.lists(st.integers(-40, 340), max_size=120),
)
def test_a_token_bitmask_sets_exactly_its_ids_in_the_vocabulary(vocab_size: int, ids: list[int]) -> None:
    """xgrammar's layout: token t is bit t % 32 of int32 word t // 32 (bit 31 the sign bit)."""
    from worker.logits_processor.structured_grammar import _bits_of, bitmask_words

    words = _bits_of(ids, vocab_size)
    assert words.dtype == torch.int32 and words.shape == (bitmask_words(vocab_size),)
    as_unsigned = [int(w) & 0xFFFFFFFF for w in words]
    got = {32 * i + b for i, w in enumerate(as_unsigned) for b in range(32) if w >> b & 1}
    assert got == {t for t in ids if 0 <= t < vocab_size}
