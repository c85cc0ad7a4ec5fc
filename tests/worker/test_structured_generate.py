"""Structured outputs end to end through the offline LLM: only the constraint can make the tiny
random model's noise valid, so every output that parses and validates proves the mask worked.

Runs on a one-layer sibling of the tiny model (same 3000-token byte-level BPE tokenizer), built
once and cached on disk, so 50 generations per constraint kind stay cheap on two cores.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from worker import LLM, SamplingParams
from worker.logits_processor.structured_grammar import compiler_for
from worker.models import build_tiny_model, default_model_path
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
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
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
            "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                           "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}},
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


@pytest.fixture(scope="module")
def llm() -> LLM:
    path = build_tiny_model(
        default_model_path().parent / "tiny-llama-1layer",
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
    )
    return LLM(str(path), max_num_seqs=64, dtype="float32")


def _gen(llm: LLM, so: dict, max_tokens: int = 96, **kw: object) -> list:
    params = [SamplingParams(structured_outputs=dict(so), max_tokens=max_tokens, seed=i, **kw) for i in range(N)]
    return [o.outputs[0] for o in llm.generate([f"prompt {i}" for i in range(N)], params, use_tqdm=False)]


def _kinds() -> dict[str, tuple[dict, object]]:
    def schema_check(schema: dict):
        return lambda text: jsonschema.validate(json.loads(text), schema)

    def full(rx: re.Pattern[str]):
        def check(text: str) -> None:
            assert rx.fullmatch(text), text
        return check

    kinds: dict[str, tuple[dict, object]] = {
        f"json:{name}": ({"json": schema}, schema_check(schema)) for name, schema in SCHEMAS.items()
    }
    kinds["regex"] = ({"regex": REGEX}, full(re.compile(REGEX)))
    kinds["choice"] = ({"choice": CHOICES}, lambda text: CHOICES.index(text))
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
        check(c.text)  # type: ignore[operator]
    assert len({c.text for c in outs}) > 1  # the noise varies; the constraint holds it


@pytest.mark.slow
def test_json_object_outputs_are_objects_or_valid_prefixes(llm: LLM) -> None:
    """Any JSON object is unbounded (free strings), so some runs hit max_tokens: `length`
    outputs must still be a prefix the grammar accepts; `stop` outputs parse as objects."""
    outs = _gen(llm, {"json_object": True}, max_tokens=48)
    compiled = compiler_for(llm.get_tokenizer(), llm.engine.vocab_size).compile(StructuredOutputsParams(json_object=True))
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
