"""The wire schema: generated code is fresh, SamplingParams is complete, JsonValue keeps types."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client import json_from_pb, json_to_pb
from client.convert import SAMPLING_FIELDS
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from client.pb.logitpool.v1 import logitpool_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "client" / "pb"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "pb"
    subprocess.run(
        [sys.executable, str(REPO / "protos" / "generate.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh, committed = _tree(out), _tree(COMMITTED)
    assert sorted(fresh) == sorted(committed), "run `python protos/generate.py` and commit client/pb"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert stale == [], f"stale generated files {stale}: run `python protos/generate.py`"


def test_generated_modules_import_under_the_client_package() -> None:
    assert callable(logitpool_pb2_grpc.add_LogitPoolServicer_to_server)
    assert pb.DESCRIPTOR.name == "logitpool/v1/logitpool.proto"  # proto-root name, as reflection expects
    service = pb.DESCRIPTOR.services_by_name["LogitPool"]
    assert service.full_name == "logitpool.v1.LogitPool"
    assert {m.name for m in service.methods} == {"Generate", "GenerateStream", "ListProcessors"}
    assert service.methods_by_name["GenerateStream"].server_streaming
    assert not service.methods_by_name["Generate"].server_streaming


def test_sampling_params_message_covers_every_engine_field() -> None:
    from worker.sampling_params import SamplingParams

    engine = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    assert engine == SAMPLING_FIELDS


def test_every_sampling_scalar_can_be_left_unset() -> None:
    """Unset must mean "engine default", so every non-repeated field tracks presence."""
    for f in pb.SamplingParams.DESCRIPTOR.fields:
        if not f.is_repeated:
            assert f.has_presence, f.name
    empty = pb.SamplingParams.FromString(pb.SamplingParams().SerializeToString())
    assert not any(empty.HasField(f.name) for f in pb.SamplingParams.DESCRIPTOR.fields if not f.is_repeated)


# -- JsonValue --------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    """Equal with exactly the same types all the way down (1 != 1.0 != True here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def _over_the_wire(value: Any) -> Any:
    return json_from_pb(pb.JsonValue.FromString(json_to_pb(value).SerializeToString()))


@given(json_values)
def test_json_value_round_trips_with_exact_types(value: Any) -> None:
    assert _same(_over_the_wire(value), value)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (67, "int_value"),
        (67.0, "double_value"),
        (True, "bool_value"),
        (None, "null_value"),
        ("67", "string_value"),
        ([], "list_value"),
        ({}, "object_value"),
        (2**63 - 1, "int_value"),
    ],
)
def test_json_value_kind(value: Any, kind: str) -> None:
    assert json_to_pb(value).WhichOneof("kind") == kind
    assert _same(_over_the_wire(value), value)


def test_json_tuple_becomes_list() -> None:
    assert _same(_over_the_wire((1, "a")), [1, "a"])


@pytest.mark.parametrize(
    ("value", "error"), [(2**63, ValueError), ({1: "a"}, TypeError), ({1, 2}, TypeError), (b"x", TypeError)]
)
def test_json_value_rejects_what_json_cannot_hold(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        json_to_pb(value)


def test_json_value_without_a_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="no value"):
        json_from_pb(pb.JsonValue())


def test_messages_pickle_round_trip():
    """Serve's gRPC proxy pickles requests to hand them to a replica: the module the classes are
    registered under must be importable (client.pb..., not the bare proto package)."""
    import pickle

    from client.pb.logitpool.v1 import logitpool_pb2 as pb

    msg = pb.GenerateRequest(prompt="x", params=pb.SamplingParams(max_tokens=3))
    assert pickle.loads(pickle.dumps(msg)) == msg
    assert type(msg).__module__ == "client.pb.logitpool.v1.logitpool_pb2"
