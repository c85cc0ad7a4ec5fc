"""Prompt logprobs of one prefill chunk: each next prompt token's raw logprob, rank and the top-k."""

from __future__ import annotations

import torch


def prompt_logprobs_topk(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``logits`` [m, V] predict ``targets`` [m] (the prompt token that follows each position).

    Returns (ids [m, 1 + k], logprobs [m, 1 + k], ranks [m]): column 0 is the target, columns
    1..k the top-k in rank order; rank is 1-based, count(logprob >= target's), as the sampler and
    vLLM count it.
    """
    lp = torch.log_softmax(logits.to(torch.float32), -1)
    target_lp = lp.gather(1, targets[:, None])
    ranks = torch.ge(lp, target_lp).sum(-1)
    top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    ids = torch.cat([targets[:, None], top_ids], 1)
    return ids, torch.cat([target_lp, top_lp], 1), ranks
