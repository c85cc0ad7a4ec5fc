"""ListProcessors on the wire: every field describe() gives reaches the client (no Ray needed)."""

from __future__ import annotations

import torch

from client.convert import processors_from_pb
from cluster.rpc.convert import processors_pb
from tests.fixtures.seed_processors import DummyLogitsProcessor, RaisingLogitsProcessor
from worker.logits_processor.registry import build_logits_processors


def test_list_processors_carries_keys_schema_and_invariance() -> None:
    described = build_logits_processors(
        None, torch.device("cpu"), False, (DummyLogitsProcessor, RaisingLogitsProcessor)
    ).describe()
    infos = {i.name: i for i in processors_from_pb(processors_pb(described))}
    assert [i.name for i in processors_from_pb(processors_pb(described))] == [d.name for d in described]
    for d in described:
        info = infos[d.name]
        assert info.fqcn == d.fqcn and info.argmax_invariant == d.argmax_invariant
        assert info.extra_args_keys == (d.extra_args_keys or ())
        assert info.extra_args_schema == d.extra_args_schema
    assert infos["DRYLogitsProcessor"].extra_args_keys[:2] == ("dry_allowed_length", "dry_base")
    assert infos["MirostatLogitsProcessor"].argmax_invariant
    # Declared keys reach the wire (ListProcessors once sent none at all).
    assert infos["RaisingLogitsProcessor"].extra_args_keys == ("raise_in",)
    assert (
        infos["DummyLogitsProcessor"].extra_args_keys == () and infos["DummyLogitsProcessor"].extra_args_schema is None
    )
