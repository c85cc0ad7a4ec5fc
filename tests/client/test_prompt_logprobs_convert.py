"""Prompt logprobs across the gRPC conversion: engine RequestOutput -> wire -> client types.

The server side (cluster/rpc/convert.py) and the client side (client/convert.py) are separate
codecs; a round trip through real protobuf bytes shows they agree (and that "not asked" and
"a one-token prompt" stay distinguishable)."""

from __future__ import annotations

from client.convert import chunks_from_pb, completion_from_pb, sampling_params_to_pb
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.rpc.convert import delta_pb, response_pb, sampling_params_from_pb
from worker.outputs import CompletionOutput, Logprob, RequestOutput

PROMPT = [4, 7, 9]
PLP = [None, {7: Logprob(-2.5, 3, "<7>"), 1: Logprob(-0.25, 1, "<1>")}, {9: Logprob(-0.5, 1, "<9>")}]


def decode(tok: int) -> str:
    return f"<{tok}>"


def _out(plp) -> RequestOutput:
    return RequestOutput(
        "r", None, PROMPT, [CompletionOutput(0, "<3>", [3], None, None, "length")], True, prompt_logprobs=plp
    )


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_prompt_logprobs_param_round_trips():
    assert sampling_params_from_pb(_wire(sampling_params_to_pb({"prompt_logprobs": 2}))).prompt_logprobs == 2
    assert sampling_params_from_pb(pb.SamplingParams()).prompt_logprobs is None


def test_response_prompt_logprobs_round_trip():
    got = completion_from_pb(_wire(response_pb("r", _out(PLP), decode))).prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    first = got[1]
    assert (first.token_id, first.logprob, first.rank, first.token) == (7, -2.5, 3, "<7>")
    assert [(t.token_id, t.rank) for t in first.top] == [(1, 1), (7, 3)]
    assert (got[2].token_id, got[2].rank, [t.token_id for t in got[2].top]) == (9, 1, [9])


def test_unasked_and_one_token_prompts_differ():
    assert completion_from_pb(_wire(response_pb("r", _out(None), decode))).prompt_logprobs is None
    one = RequestOutput("r", None, [4], _out(None).outputs, True, prompt_logprobs=[None])
    assert completion_from_pb(_wire(response_pb("r", one, decode))).prompt_logprobs == (None,)


def test_stream_carries_prompt_logprobs_on_the_first_chunk():
    delta = _out(PLP)
    delta.prompt_token_ids = []  # deltas arrive without the prompt; the server passes it in
    chunks = chunks_from_pb(_wire(delta_pb("r", delta, decode, prompt_token_ids=PROMPT)))
    assert [p.token_id if p else None for p in chunks[0].prompt_logprobs] == [None, 7, 9]
    later = chunks_from_pb(_wire(delta_pb("r", _out(None), decode, prompt_token_ids=PROMPT)))
    assert later[0].prompt_logprobs is None
