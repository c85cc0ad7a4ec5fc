"""Loading processors (docs/sampling.md "Programming model"): FQCN, class objects, real entry points;
order; failures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.seed_processors import DummyLogitsProcessor, RaisingLogitsProcessor, WrappedPerReqLogitsProcessor
from worker.batch import PersistentBatch
from worker.logits_processor import LogitsProcessor, LogitsProcessorLoadError, ProcessorError
from worker.logits_processor.builtin import (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from worker.logits_processor.library import LIBRARY_PROCESSORS
from worker.logits_processor.penalties import PenaltiesLogitsProcessor
from worker.logits_processor.registry import (
    ENTRY_POINT_GROUP,
    ProcessorInfo,
    build_logits_processors,
    entry_point_classes,
    fqcn_of,
    resolve_processor_class,
)
from worker.logits_processor.structured import StructuredOutputsLogitsProcessor
from worker.sampling_params import SamplingParams

CPU = torch.device("cpu")
PLUGIN_SITE = Path(__file__).resolve().parents[1] / "fixtures" / "plugin_site"
DUMMY = "tests.fixtures.seed_processors:DummyLogitsProcessor"
BUILTINS = [
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    StructuredOutputsLogitsProcessor,
    MinPLogitsProcessor,
]


def _build(custom: tuple = (), entry_points: bool = False) -> Any:
    return build_logits_processors(None, CPU, False, custom, entry_points=entry_points)


def _classes(procs: Any) -> list[type]:
    """The loaded classes, less the library's own (registered as entry points of this package)."""
    return [type(p) for p in procs.all if type(p) not in LIBRARY_PROCESSORS]


def _plugins() -> list[type]:
    return [c for c in entry_point_classes() if c not in LIBRARY_PROCESSORS]


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["no_colon", "a.b:C:D", ":DummyLogitsProcessor", "tests.fixtures.seed_processors:", ""]
)
def test_bad_format(spec: str) -> None:
    with pytest.raises(LogitsProcessorLoadError) as info:
        resolve_processor_class(spec)
    assert repr(spec) in str(info.value) and "bad format" in str(info.value)


def test_module_not_found_chains_the_cause() -> None:
    spec = "tests.fixtures.no_such_module:Proc"
    with pytest.raises(LogitsProcessorLoadError) as info:
        resolve_processor_class(spec)
    msg = str(info.value)
    assert repr(spec) in msg and "module 'tests.fixtures.no_such_module' could not be imported" in msg
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_module_raising_at_import_chains_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "h1_broken_procs.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "h1_broken_procs", raising=False)
    with pytest.raises(LogitsProcessorLoadError, match=r"h1_broken_procs:Proc.*boom at import") as info:
        resolve_processor_class("h1_broken_procs:Proc")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_missing_attribute() -> None:
    spec = "tests.fixtures.seed_processors:NoSuchProcessor"
    with pytest.raises(LogitsProcessorLoadError) as info:
        resolve_processor_class(spec)
    assert repr(spec) in str(info.value) and "has no attribute 'NoSuchProcessor'" in str(info.value)


@pytest.mark.parametrize("spec", ["worker.testing:check_processor", "tests.fixtures.seed_processors:torch", 42])
def test_not_a_class(spec: Any) -> None:
    with pytest.raises(LogitsProcessorLoadError, match="is not a class"):
        resolve_processor_class(spec)


@pytest.mark.parametrize("spec", ["tests.fixtures.seed_processors:DummyPerReqLogitsProcessor", dict])
def test_not_a_subclass(spec: Any) -> None:
    with pytest.raises(LogitsProcessorLoadError, match="is not a subclass of LogitsProcessor") as info:
        resolve_processor_class(spec)
    assert ("DummyPerReqLogitsProcessor" if isinstance(spec, str) else "builtins:dict") in str(info.value)


def test_abstract_class_is_rejected() -> None:
    with pytest.raises(LogitsProcessorLoadError, match=r"is abstract.*new_req_logits_processor"):
        resolve_processor_class("worker.logits_processor:AdapterLogitsProcessor")


class _FailingInit(LogitsProcessor):
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise RuntimeError("no GPU here")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        return None


def test_constructor_failure_names_the_class() -> None:
    with pytest.raises(LogitsProcessorLoadError, match=r"test_registry:_FailingInit.*no GPU here") as info:
        _build((_FailingInit,))
    assert isinstance(info.value.__cause__, RuntimeError)


# -- successful loading and order --------------------------------------------------------------


def test_fqcn_and_class_object_resolve_to_the_same_class() -> None:
    assert resolve_processor_class(DUMMY) is DummyLogitsProcessor
    assert resolve_processor_class(DummyLogitsProcessor) is DummyLogitsProcessor
    assert fqcn_of(DummyLogitsProcessor) == DUMMY
    assert resolve_processor_class(fqcn_of(MinPLogitsProcessor)) is MinPLogitsProcessor


def test_registry_order_builtins_then_custom_and_penalties_apart() -> None:
    procs = _build((DUMMY, WrappedPerReqLogitsProcessor))
    assert _classes(procs) == [*BUILTINS, DummyLogitsProcessor, WrappedPerReqLogitsProcessor]
    assert isinstance(procs.penalties, PenaltiesLogitsProcessor)
    assert not any(isinstance(p, PenaltiesLogitsProcessor) for p in procs.all)
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor]
    assert [type(p) for p in procs.non_argmax_invariant] == [
        *[c for c in BUILTINS if c is not MinPLogitsProcessor],
        DummyLogitsProcessor,
        WrappedPerReqLogitsProcessor,
    ]


def test_duplicates_load_once_at_their_first_position() -> None:
    procs = _build((DUMMY, MinPLogitsProcessor, DummyLogitsProcessor, PenaltiesLogitsProcessor))
    assert _classes(procs) == [*BUILTINS, DummyLogitsProcessor]


class _CountsInvariance(DummyLogitsProcessor):
    calls = 0

    def is_argmax_invariant(self) -> bool:
        type(self).calls += 1
        return True


def test_argmax_invariance_is_read_once_at_construction() -> None:
    _CountsInvariance.calls = 0
    procs = _build((_CountsInvariance,))
    assert _CountsInvariance.calls == 1
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor, _CountsInvariance]
    procs.describe()
    assert _CountsInvariance.calls == 1


# -- entry points (a real dist-info folder put on sys.path) -------------------------------------


def test_entry_point_is_discovered_from_a_real_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGIN_SITE))
    assert _plugins() == [DummyLogitsProcessor]
    procs = _build((WrappedPerReqLogitsProcessor, DUMMY), entry_points=True)
    assert _classes(procs) == [*BUILTINS, DummyLogitsProcessor, WrappedPerReqLogitsProcessor]
    assert _classes(_build(entry_points=False)) == BUILTINS


def test_the_library_loads_through_this_package_s_own_entry_points() -> None:
    names = [c.__name__ for c in entry_point_classes()]
    assert names == [c.__name__ for c in LIBRARY_PROCESSORS]  # sorted by entry-point name
    assert [type(p) for p in _build(entry_points=True).all][len(BUILTINS) :] == list(LIBRARY_PROCESSORS)


def test_without_the_distribution_nothing_extra_loads() -> None:
    assert str(PLUGIN_SITE) not in sys.path
    assert _plugins() == []
    assert _classes(_build(entry_points=True)) == BUILTINS


def test_entry_points_load_sorted_by_name_and_bad_ones_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "h1_more_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: h1-more-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nzz_wrapped = tests.fixtures.seed_processors:WrappedPerReqLogitsProcessor\n"
        "aa_raising = tests.fixtures.seed_processors:RaisingLogitsProcessor\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGIN_SITE))
    assert _plugins() == [RaisingLogitsProcessor, DummyLogitsProcessor, WrappedPerReqLogitsProcessor]

    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nbroken = tests.fixtures.seed_processors:Nope\n")
    with pytest.raises(LogitsProcessorLoadError, match=r"entry point 'broken'.*has no attribute 'Nope'"):
        _build(entry_points=True)


# -- the loaded set at run time -----------------------------------------------------------------


def test_update_state_wraps_a_failure_naming_the_processor() -> None:
    procs = _build((RaisingLogitsProcessor,))
    batch = PersistentBatch(2)
    procs.update_state(batch.update([], [("ok", SamplingParams(), [1], [])]))
    bad = SamplingParams(extra_args={"raise_in": "update_state"})
    with pytest.raises(ProcessorError) as info:
        procs.update_state(batch.update([], [("bad", bad, [1], [])]))
    err = info.value
    assert (err.processor, err.phase) == ("RaisingLogitsProcessor", "update_state")
    assert isinstance(err.cause, RuntimeError) and err.__cause__ is err.cause
    assert "RaisingLogitsProcessor failed in update_state" in str(err)


def test_validate_params_lets_a_value_error_through_unchanged() -> None:
    procs = _build((DUMMY, RaisingLogitsProcessor))
    procs.validate_params(SamplingParams(extra_args={"target_token": 3, "raise_in": "apply"}))
    with pytest.raises(ValueError, match="target_token value x is not int") as info:
        procs.validate_params(SamplingParams(extra_args={"target_token": "x"}))
    assert type(info.value) is ValueError
    with pytest.raises(ValueError, match=r"^raise_in: must be"):
        procs.validate_params(SamplingParams(extra_args={"raise_in": "never"}))


def test_describe_lists_every_processor_with_its_extra_args() -> None:
    typed = _build((DUMMY, RaisingLogitsProcessor)).describe()
    assert all(isinstance(r, ProcessorInfo) for r in typed)
    rows = [r.as_json() for r in typed]
    assert [r["name"] for r in rows] == [
        *[c.__name__ for c in BUILTINS],
        "DummyLogitsProcessor",
        "RaisingLogitsProcessor",
        "PenaltiesLogitsProcessor",
    ]
    by_name = {r["name"]: r for r in rows}
    assert by_name["DummyLogitsProcessor"] == {
        "name": "DummyLogitsProcessor",
        "fqcn": DUMMY,
        "argmax_invariant": False,
        "extra_args_keys": None,
        "extra_args_schema": None,
    }
    assert by_name["RaisingLogitsProcessor"]["extra_args_keys"] == ["raise_in"]
    assert by_name["RaisingLogitsProcessor"]["extra_args_schema"] == RaisingLogitsProcessor.extra_args_schema
    assert by_name["MinPLogitsProcessor"]["argmax_invariant"] is True
    assert all(resolve_processor_class(r["fqcn"]).__name__ == r["name"] for r in rows)
