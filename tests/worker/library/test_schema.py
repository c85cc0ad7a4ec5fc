"""Declared extra_args: schema validation, strict keys, what describe() publishes, back-compat."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch
from pydantic import Field

from tests.fixtures.seed_processors import DummyLogitsProcessor, RaisingLogitsProcessor
from worker.logits_processor import LogitsProcessor
from worker.logits_processor.library import LIBRARY_PROCESSORS, DRYLogitsProcessor, XTCLogitsProcessor
from worker.logits_processor.registry import build_logits_processors
from worker.logits_processor.schema import ExtraArgs, declared_keys, json_schema
from worker.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _build(*custom: Any, strict: bool = True) -> Any:
    return build_logits_processors(SimpleNamespace(strict_extra_args=strict), CPU, False, custom, entry_points=True)


class _Keyed(LogitsProcessor):
    """Declares bare keys, no schema."""

    extra_args_keys = ("my_flag",)

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass


class _ModelArgs(ExtraArgs):
    level: int = Field(ge=0, le=3)
    label: str = Field("x", alias="my-label")


class _Modelled(_Keyed):
    extra_args_model = _ModelArgs
    extra_args_keys = None


def _p(**extra: Any) -> SamplingParams:
    return SamplingParams(extra_args=extra)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"xtc_probability": "0.5"}, "xtc_probability"),  # a string is not a number (strict JSON types)
        ({"xtc_probability": 1.5}, "xtc_probability"),
        ({"xtc_probability": 0.5, "xtc_threshold": 0}, "xtc_threshold"),
        ({"dry_multiplier": 1, "dry_allowed_length": True}, "dry_allowed_length"),
        ({"dry_multiplier": 1, "dry_sequence_breakers": [[]]}, "dry_sequence_breakers.0"),
        ({"mirostat": 1}, "mirostat"),
    ],
)
def test_default_validate_params_names_the_bad_key(extra: dict, field: str) -> None:
    procs = _build()
    with pytest.raises(ValueError, match=rf"^extra_args\.{field}: "):
        procs.validate_params(_p(**extra))


def test_valid_library_args_pass_and_ints_are_accepted_for_floats() -> None:
    _build().validate_params(_p(dry_multiplier=1, dry_sequence_breakers=[[10], [11, 12]], xtc_probability=1, top_a=0))


def test_unknown_key_is_rejected_listing_the_known_keys() -> None:
    with pytest.raises(ValueError) as info:
        _build(_Keyed).validate_params(_p(xtc_treshold=0.1, my_flag=True))
    msg = str(info.value)
    assert msg.startswith("extra_args: unknown key(s) 'xtc_treshold';")
    assert "xtc_threshold" in msg and "my_flag" in msg and "dry_base" in msg


def test_strict_checking_is_off_while_an_undeclared_processor_is_loaded_or_by_config() -> None:
    seeds = _build(DummyLogitsProcessor)  # the seeds' processor declares nothing: it may read anything
    assert not seeds.strict_extra_args
    seeds.validate_params(_p(target_token=3, anything=1))
    with pytest.raises(ValueError, match="target_token"):
        seeds.validate_params(_p(target_token="x"))  # its own validate_params still runs
    lax = _build(strict=False)
    assert not lax.strict_extra_args
    lax.validate_params(_p(anything=1))
    with pytest.raises(ValueError, match=r"extra_args\.top_a"):
        lax.validate_params(_p(top_a=2.0))  # declared keys are still validated


def test_every_declaration_form_claims_its_keys() -> None:
    assert declared_keys(_Keyed) == {"my_flag"}
    assert declared_keys(_Modelled) == {"level", "my-label"}  # by alias
    assert declared_keys(RaisingLogitsProcessor) == {"raise_in"}  # the older JSON-schema dict
    assert declared_keys(DummyLogitsProcessor) is None
    procs = _build(_Modelled, RaisingLogitsProcessor)
    assert procs.strict_extra_args
    procs.validate_params(_p(level=2, **{"my-label": "y"}, raise_in="apply"))
    with pytest.raises(ValueError, match=r"extra_args\.level"):
        procs.validate_params(_p(level=7))


def test_describe_publishes_keys_schema_and_invariance() -> None:
    rows = {r.name: r.as_json() for r in _build(DummyLogitsProcessor, RaisingLogitsProcessor).describe()}
    assert rows["DummyLogitsProcessor"]["extra_args_keys"] is None
    assert rows["RaisingLogitsProcessor"]["extra_args_schema"] == RaisingLogitsProcessor.extra_args_schema
    assert rows["MinPLogitsProcessor"]["extra_args_keys"] == []
    assert rows["XTCLogitsProcessor"] == {
        "name": "XTCLogitsProcessor",
        "fqcn": "worker.logits_processor.library.xtc:XTCLogitsProcessor",
        "argmax_invariant": False,
        "extra_args_keys": ["xtc_probability", "xtc_threshold"],
        "extra_args_schema": json_schema(XTCLogitsProcessor),
    }
    assert rows["TopALogitsProcessor"]["argmax_invariant"] is True


@pytest.mark.parametrize("cls", LIBRARY_PROCESSORS, ids=lambda c: c.__name__)
def test_published_schema_is_valid_json_schema_that_agrees_with_validation(cls: type) -> None:
    schema = json_schema(cls)
    assert schema is not None
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["properties"]) == declared_keys(cls)
    bad = {k: "not-a-number" for k in schema.get("required", schema["properties"])}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    with pytest.raises(ValueError):
        cls.validate_params(SamplingParams(extra_args=bad))


def test_dry_breakers_schema_lists_token_sequences() -> None:
    schema = json_schema(DRYLogitsProcessor)
    assert schema is not None
    props = schema["properties"]
    jsonschema.validate({"dry_multiplier": 0.8, "dry_sequence_breakers": [[13], [25, 26]]}, schema)
    assert props["dry_sequence_breakers"]["type"] == "array"


def test_the_default_registry_is_strict_every_built_in_reading_no_keys() -> None:
    """Every built-in (structured outputs included) claims no extra_args, so a default worker
    rejects a misspelt key instead of silently turning strict checking off."""
    procs = _build()
    assert procs.strict_extra_args
    assert all(r.extra_args_keys is not None for r in procs.describe()), procs.describe()
    with pytest.raises(ValueError, match="xtc_treshold"):
        procs.validate_params(_p(xtc_treshold=0.5))
