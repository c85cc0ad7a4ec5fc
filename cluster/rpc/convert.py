"""gRPC wire types <-> worker types, server side (the client has its own, in client/convert.py).

The JSON value codec for ``extra_args`` is the wire schema's and is shared with the client, so
an integer stays an integer end to end.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from client import extra_args_from_pb
from client.convert import structured_outputs_from_pb
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.chat import TEXT_TOKENS, PromptTokens
from worker.logits_processor.registry import ProcessorInfo
from worker.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from worker.sampling_params import SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}


def sampling_params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; ValueError (naming the field) when invalid."""
    kw: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        name = field.name
        if name not in _PARAM_FIELDS:
            continue
        if name == "extra_args":
            if len(msg.extra_args):
                kw[name] = extra_args_from_pb(msg.extra_args)
        elif name == "logit_bias":
            if len(msg.logit_bias):
                kw[name] = dict(msg.logit_bias)
        elif name == "structured_outputs":
            if msg.HasField(name):
                kw[name] = structured_outputs_from_pb(msg.structured_outputs)
        elif name == "allowed_token_ids":
            if msg.HasField(name):
                kw[name] = list(msg.allowed_token_ids.ids)
        elif field.is_repeated:
            kw[name] = list(getattr(msg, name))
        elif msg.HasField(name):
            kw[name] = getattr(msg, name)
    return SamplingParams(**kw)


def prompt_from_pb(req: pb.GenerateRequest) -> str | list[int]:
    which = req.WhichOneof("input")
    if which == "prompt":
        return req.prompt
    if which == "prompt_token_ids":
        return list(req.prompt_token_ids.ids)
    raise ValueError("prompt: give prompt or prompt_token_ids")


def prompt_tokens_from_pb(req: pb.GenerateRequest) -> PromptTokens:
    """Special tokens for a text prompt: the request's choice, else the completions default."""
    return (
        PromptTokens(add_special_tokens=req.add_special_tokens) if req.HasField("add_special_tokens") else TEXT_TOKENS
    )


def _logprobs_pb(
    positions: list[PositionLogprobs] | None, token_ids: list[int], decode: Any
) -> list[pb.PositionLogprobs]:
    if positions is None:
        return []
    out = []
    for tok, position in zip(token_ids, positions):
        sampled = position[tok]
        out.append(
            pb.PositionLogprobs(
                token_id=tok,
                logprob=sampled.logprob,
                rank=sampled.rank,
                token=decode(tok),
                top=[
                    pb.TopLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank, token=decode(t))
                    for t, lp in sorted(position.items(), key=lambda kv: kv[1].rank)
                ],
            )
        )
    return out


def _prompt_logprobs_pb(out: RequestOutput, prompt_token_ids: list[int], decode: Any) -> pb.PromptLogprobs | None:
    """Positions 1.. of the prompt (the first has none), or None when the request did not ask."""
    plp = out.prompt_logprobs
    if plp is None:
        return None
    return pb.PromptLogprobs(positions=_logprobs_pb(plp[1:], prompt_token_ids[1:], decode))  # type: ignore[arg-type]  # only [0] is None: sent once the rest are in


def _usage(out: RequestOutput) -> pb.Usage:
    n_prompt = len(out.prompt_token_ids)
    n_out = sum(len(c.token_ids) for c in out.outputs)
    return pb.Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        cached_tokens=out.num_cached_tokens or 0,
    )


def response_pb(request_id: str, out: RequestOutput, decode: Any) -> pb.GenerateResponse:
    completions = []
    for c in out.outputs:
        msg = pb.Completion(
            index=c.index,
            text=c.text,
            token_ids=c.token_ids,
            finish_reason=c.finish_reason or "",
            logprobs=_logprobs_pb(c.logprobs, c.token_ids, decode),
            error=c.error or "",
        )
        if c.cumulative_logprob is not None:
            msg.cumulative_logprob = c.cumulative_logprob
        completions.append(msg)
    return pb.GenerateResponse(
        request_id=request_id,
        completions=completions,
        usage=_usage(out),
        prompt_logprobs=_prompt_logprobs_pb(out, out.prompt_token_ids, decode),
    )


def delta_pb(
    request_id: str,
    delta: RequestOutput,
    decode: Any,
    usage: RequestOutput | None = None,
    prompt_token_ids: list[int] | None = None,
) -> pb.GenerateStreamResponse:
    """``prompt_token_ids``: the request's prompt (deltas arrive without it), for prompt logprobs."""

    def one(c: CompletionOutput) -> pb.CompletionDelta:
        return pb.CompletionDelta(
            index=c.index,
            text=c.text,
            token_ids=c.token_ids,
            logprobs=_logprobs_pb(c.logprobs, c.token_ids, decode),
            finish_reason=c.finish_reason or "",
            error=c.error or "",
        )

    msg = pb.GenerateStreamResponse(request_id=request_id, deltas=[one(c) for c in delta.outputs])
    plp = _prompt_logprobs_pb(delta, prompt_token_ids or delta.prompt_token_ids, decode)
    if plp is not None:
        msg.prompt_logprobs.CopyFrom(plp)
    if usage is not None:
        msg.usage.CopyFrom(_usage(usage))
    return msg


def processors_pb(described: list[ProcessorInfo]) -> pb.ListProcessorsResponse:
    infos = []
    for d in described:
        info = pb.ProcessorInfo(
            name=d.name,
            fqcn=d.fqcn,
            argmax_invariant=d.argmax_invariant,
            extra_args_keys=d.extra_args_keys or (),  # None (undeclared) travels as []
        )
        if d.extra_args_schema is not None:
            info.extra_args_schema_json = json.dumps(d.extra_args_schema)
        infos.append(info)
    return pb.ListProcessorsResponse(processors=infos)
