"""What the front end sends for fair admission, in Serve's local testing mode against the fake
engine (tests/cluster_rayfree/test_frontend_local.py's fixtures): one group per client request (every
prompt of a batch), the API key's non-secret tenant id, vLLM's `priority` on HTTP and gRPC, and
limits.max_sequences_per_request refusing prompts x n before anything reaches a worker."""

from __future__ import annotations

import asyncio

import pytest

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster import limits as request_limits
from cluster.frontend import Frontend, tenant_id
from cluster.limits import Limits
from cluster.rpc.service import GrpcAdapter
from tests.cluster_rayfree.fake_engine import FakeEngine
from tests.cluster_rayfree.test_frontend_local import KEY, _ctx, cfg, fe, http, worker  # noqa: F401 - fixtures
from worker.request import Scheduling
from worker.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeEngine, "scheduling", [])


def test_a_batch_is_one_group_under_the_keys_tenant(fe: Frontend) -> None:  # noqa: F811 - fixture
    r = http(fe, "POST", "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1, "priority": -2})
    assert r.status_code == 200, r.text
    scheds = FakeEngine.scheduling
    assert len(scheds) == 3 and all(isinstance(s, Scheduling) for s in scheds)
    assert {s.group for s in scheds} == {r.json()["id"]}  # the response id: one group for the batch
    assert {s.priority for s in scheds} == {-2}
    tenant = scheds[0].tenant
    assert tenant == tenant_id(f"Bearer {KEY}") and len(tenant) == 12 and KEY not in tenant


def test_chat_and_streams_carry_it_too(fe: Frontend) -> None:  # noqa: F811 - fixture
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 3}
    for stream in (False, True):
        r = http(fe, "POST", "/v1/chat/completions", {**body, "stream": stream})
        assert r.status_code == 200, r.text
    r = http(fe, "POST", "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 1, "stream": True})
    assert r.status_code == 200, r.text
    chat, chat_stream, *batch = FakeEngine.scheduling
    assert chat.priority == chat_stream.priority == 3 and chat.group != chat_stream.group
    assert len(batch) == 2 and batch[0].group == batch[1].group and batch[0].priority == 0


def test_grpc_priority_reaches_the_worker(fe: Frontend) -> None:  # noqa: F811 - fixture
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[8, 1]), params=pb.SamplingParams(max_tokens=2), request_id="c-1", priority=7
    )
    asyncio.run(GrpcAdapter(fe).generate(req, _ctx()))
    (sched,) = FakeEngine.scheduling
    assert sched.priority == 7 and sched.group.startswith("c-1-") and sched.tenant == tenant_id(f"Bearer {KEY}")


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, "high", 1.5])
def test_priority_out_of_range_is_a_400(fe: Frontend, priority: object) -> None:  # noqa: F811 - fixture
    r = http(fe, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": priority})
    assert r.status_code == 400 and "priority" in r.text
    assert FakeEngine.scheduling == []


def test_prompts_times_n_beyond_the_limit_is_a_400_naming_it(fe: Frontend) -> None:  # noqa: F811 - fixture
    """The issue's hog: 64 prompts x n 64 = 4,096 sequences in a 2.7 KB body."""
    r = http(fe, "POST", "/v1/completions", {"prompt": ["hi"] * 64, "n": 64, "max_tokens": 4})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "limits.max_sequences_per_request (256)" in msg and "4096" in msg
    assert FakeEngine.scheduling == []
    ok = http(fe, "POST", "/v1/completions", {"prompt": ["hi"] * 64, "n": 4, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_the_sequence_limit_is_one_rule_for_both_protocols() -> None:
    limits = Limits(max_n=8, max_prompts=8, max_sequences_per_request=8)
    request_limits.check_request(limits, SamplingParams(n=8), 1)
    request_limits.check_request(limits, SamplingParams(n=2), 4)
    with pytest.raises(ValueError, match=r"limits\.max_sequences_per_request \(8\)"):
        request_limits.check_request(limits, SamplingParams(n=3), 3)
    with pytest.raises(ValueError, match="max_n"):
        Limits(max_n=300)  # a max_n the sequence limit would never let through
