"""Structured outputs end to end through the offline LLM: only the constraint can make the tiny
random model's noise valid, so every output that parses and validates proves the mask worked.

Runs on a one-layer sibling of the tiny model (same 3000-token byte-level BPE tokenizer), built
once and cached on disk, so 50 generations per constraint kind stay cheap on two cores.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from tests.worker.model_fixtures import suite_engine_kwargs
from worker import LLM, SamplingParams
from worker.logits_processor.structured_grammar import compiler_for
from worker.model.loader import build_tiny_model, default_model_path
from worker.structured_outputs import StructuredOutputsParams

N = 50

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            },
            "kind": {"enum": ["p", "q", "r"]},
            "ok": {"type": "boolean"},
        },
        "required": ["point", "kind", "ok"],
    },
    "list_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
            },
            "required": ["id", "v"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']
EBNF = 'root ::= "(" num (("+" | "*") num){0,3} ")"\nnum ::= [0-9] | [1-9] [0-9]'
EBNF_TEXT = re.compile(r"\((?:[0-9]|[1-9][0-9])(?:[+*](?:[0-9]|[1-9][0-9])){0,3}\)")
LARK = 'start: WORD ("," WORD)~0..2 "."\nWORD: /[a-z]{1,6}/'
LARK_TEXT = re.compile(r"[a-z]{1,6}(,[a-z]{1,6}){0,2}\.")


def one_layer_model_path() -> Path:
    """The tiny model's one-layer sibling (built once, cached on disk)."""
    return build_tiny_model(
        default_model_path().parent / "tiny-llama-1layer",
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def llm() -> LLM:
    path = one_layer_model_path()
    return LLM(str(path), max_num_seqs=64, dtype="float32", **{"device": "cpu", **suite_engine_kwargs()})


def _gen(llm: LLM, so: dict, max_tokens: int = 96, **kw: object) -> list:
    params = [SamplingParams(structured_outputs=dict(so), max_tokens=max_tokens, seed=i, **kw) for i in range(N)]
    return [o.outputs[0] for o in llm.generate([f"prompt {i}" for i in range(N)], params, use_tqdm=False)]


def _kinds() -> dict[str, tuple[dict, Callable[[str], object]]]:
    def schema_check(schema: dict):
        return lambda text: jsonschema.validate(json.loads(text), schema)

    def full(rx: re.Pattern[str]):
        def check(text: str) -> None:
            assert rx.fullmatch(text), text

        return check

    kinds: dict[str, tuple[dict, Callable[[str], object]]] = {
        f"json:{name}": ({"json": schema}, schema_check(schema)) for name, schema in SCHEMAS.items()
    }
    kinds["regex"] = ({"regex": REGEX}, full(re.compile(REGEX)))
    kinds["choice"] = ({"choice": CHOICES}, CHOICES.index)
    kinds["grammar:ebnf"] = ({"grammar": EBNF}, full(EBNF_TEXT))
    kinds["grammar:lark"] = ({"grammar": LARK}, full(LARK_TEXT))
    return kinds


KINDS = _kinds()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_fifty_seeded_generations_all_valid(llm: LLM, kind: str) -> None:
    so, check = KINDS[kind]
    outs = _gen(llm, so)
    for c in outs:
        assert c.finish_reason == "stop", (kind, c.text)
        check(c.text)
    assert len({c.text for c in outs}) > 1  # the noise varies; the constraint holds it


@pytest.mark.slow
def test_json_object_outputs_are_objects_or_valid_prefixes(llm: LLM) -> None:
    """Any JSON object is unbounded (free strings), so some runs hit max_tokens: `length`
    outputs must still be a prefix the grammar accepts; `stop` outputs parse as objects."""
    outs = _gen(llm, {"json_object": True}, max_tokens=48)
    compiled = compiler_for(llm.get_tokenizer(), llm.engine.vocab_size).compile(
        StructuredOutputsParams(json_object=True)
    )
    stopped = 0
    for c in outs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
            stopped += 1
        else:
            assert c.finish_reason == "length"
            m = compiled.matcher()
            assert all(m.accept(t) for t in c.token_ids), c.text
    assert stopped >= 5


@pytest.mark.slow
def test_mixed_batch_constrained_and_free_rows(llm: LLM) -> None:
    """Constrained rows next to free ones, with n>1, seeds, bad_words and a +100 logit_bias on a
    token the grammar forbids: every constrained completion stays valid, free rows stay free."""
    tok = llm.get_tokenizer()
    forbidden = tok.encode("Q", add_special_tokens=False)[0]
    person = SCHEMAS["person"]
    reqs: list[tuple[str, SamplingParams, dict | None]] = []
    for i in range(8):
        reqs.append(
            ("schema", SamplingParams(structured_outputs={"json": person}, max_tokens=96, seed=100 + i), person)
        )
        reqs.append(
            (
                "choice",
                SamplingParams(
                    structured_outputs={"choice": CHOICES}, n=3, max_tokens=16, bad_words=["maybe"], temperature=1.5
                ),
                None,
            )
        )
        reqs.append(
            (
                "regex",
                SamplingParams(
                    structured_outputs={"regex": REGEX},
                    max_tokens=32,
                    seed=i if i % 2 else None,
                    logit_bias={forbidden: 100.0},
                ),
                None,
            )
        )
        reqs.append(("free", SamplingParams(max_tokens=12, seed=i, logit_bias={forbidden: 100.0}), None))
    outs = llm.generate([f"mixed {i}" for i in range(len(reqs))], [p for _, p, _ in reqs], use_tqdm=False)
    for (kind, _, schema), out in zip(reqs, outs):
        for c in out.outputs:
            if kind == "free":
                assert c.finish_reason == "length" and c.token_ids.count(forbidden) == 12  # the bias wins unconstrained
                continue
            assert c.finish_reason == "stop", (kind, c.text)
            if kind == "schema":
                jsonschema.validate(json.loads(c.text), schema)
            elif kind == "choice":
                assert c.text in CHOICES
            else:
                assert re.fullmatch(REGEX, c.text), c.text
                assert forbidden not in c.token_ids  # +100 cannot lift a token the grammar forbids
        assert len(out.outputs) == (3 if kind == "choice" else 1)


@pytest.mark.slow
def test_seeded_constrained_output_does_not_depend_on_the_batch(llm: LLM) -> None:
    params = SamplingParams(structured_outputs={"regex": REGEX}, max_tokens=32, seed=7)
    alone = llm.generate(["same prompt"], params, use_tqdm=False)[0].outputs[0].text
    mixed = (
        llm.generate(
            ["same prompt", "other", "third"],
            [
                params,
                SamplingParams(max_tokens=20),
                SamplingParams(structured_outputs={"choice": CHOICES}, max_tokens=8),
            ],
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert alone == mixed and re.fullmatch(REGEX, alone)


def test_max_tokens_mid_structure_finishes_with_length(llm: LLM) -> None:
    out = llm.generate(
        ["p"], SamplingParams(structured_outputs={"json": SCHEMAS["person"]}, max_tokens=3, seed=1), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    m = (
        compiler_for(llm.get_tokenizer(), llm.engine.vocab_size)
        .compile(StructuredOutputsParams(json=SCHEMAS["person"]))
        .matcher()
    )
    assert all(m.accept(t) for t in out.token_ids)  # a valid prefix, just unfinished
