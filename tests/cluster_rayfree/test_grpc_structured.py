"""gRPC structured outputs: the client's dict -> the typed oneof -> the server's SamplingParams (no Ray)."""

from __future__ import annotations

import pytest

from client.convert import generate_request
from cluster.rpc.convert import sampling_params_from_pb
from worker.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}}}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"json": SCHEMA}, StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"enum": [1, 2]}}}')),
        ({"regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"choice": ["x", "y z"]}, StructuredOutputsParams(choice=["x", "y z"])),
        ({"grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        ({"json_object": True}, StructuredOutputsParams(json_object=True)),
    ],
)
def test_round_trip(given: dict, expected: StructuredOutputsParams) -> None:
    req = generate_request("p", {"structured_outputs": given, "max_tokens": 4})
    assert req.params.structured_outputs.WhichOneof("kind") == next(iter(given))
    so = sampling_params_from_pb(req.params).structured_outputs
    assert so is not None and so.kind == expected.kind and so.spec == expected.spec


def test_unset_means_unconstrained() -> None:
    assert sampling_params_from_pb(generate_request("p", {"max_tokens": 4}).params).structured_outputs is None


@pytest.mark.parametrize("bad", [{}, {"regex": "a", "choice": ["a"]}, {"yaml": "x"}])
def test_client_refuses_anything_but_one_kind(bad: dict) -> None:
    with pytest.raises(ValueError, match="structured_outputs: give exactly one"):
        generate_request("p", {"structured_outputs": bad})


def test_server_refuses_an_empty_oneof() -> None:
    req = generate_request("p", {"max_tokens": 4})
    req.params.structured_outputs.SetInParent()
    with pytest.raises(ValueError, match="structured_outputs: give exactly one"):
        sampling_params_from_pb(req.params)
