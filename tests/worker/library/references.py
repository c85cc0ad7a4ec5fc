"""Plain per-row references of each library processor's published formula (no batching, no state).

Transcribed from transformers' ``logits_process.py`` (typical, epsilon, eta, no-repeat-ngram),
llama.cpp's ``llama-sampling.cpp`` (DRY, XTC, mirostat v2) and text-generation-webui (top-a).
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    scores = scores[None].clone()
    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    ent = -(normalized * p).nansum(-1, keepdim=True)
    shifted_scores = torch.abs((-normalized) - ent)
    sorted_scores, sorted_indices = torch.sort(shifted_scores, descending=False)
    sorted_logits = scores.gather(-1, sorted_indices)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    last_ind = (cumulative_probs < mass).sum(dim=1)
    last_ind.clamp_(max=sorted_scores.shape[-1] - 1)
    sorted_indices_to_remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
    sorted_indices_to_remove[..., :1] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
    return scores.masked_fill(indices_to_remove, NEG_INF)[0]


def top_a(scores: torch.Tensor, a: float) -> torch.Tensor:
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < probs.max() ** 2 * a, NEG_INF)


def epsilon(scores: torch.Tensor, eps: float) -> torch.Tensor:
    scores = scores[None]
    probabilities = scores.softmax(dim=-1)
    indices_to_remove = probabilities < eps
    indices_to_remove &= scores < torch.topk(scores, 1)[0][..., -1, None]
    return scores.masked_fill(indices_to_remove, NEG_INF)[0]


def eta(scores: torch.Tensor, eta_: float) -> torch.Tensor:
    scores = scores[None]
    probabilities = scores.softmax(dim=-1)
    entropy = torch.distributions.Categorical(logits=scores).entropy()
    cutoff = torch.min(torch.tensor(eta_), math.sqrt(eta_) * torch.exp(-entropy))[..., None]
    indices_to_remove = probabilities < cutoff
    indices_to_remove &= scores < torch.topk(scores, 1)[0][..., -1, None]
    return scores.masked_fill(indices_to_remove, NEG_INF)[0]


def xtc(scores: torch.Tensor, threshold: float, probability: float, chance: float) -> torch.Tensor:
    out = scores.clone()
    if probability <= 0.0 or threshold > 0.5 or chance > probability:
        return out
    p = torch.softmax(scores, dim=-1).tolist()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    pos_last = 0
    for i, tok in enumerate(order):
        if p[tok] >= threshold:
            pos_last = i
        else:
            break
    if pos_last > 0:
        out[order[:pos_last]] = NEG_INF
    return out


def no_repeat_ngram_banned(text: list[int], n: int) -> list[int]:
    cur_len = len(text)
    if cur_len + 1 < n:
        return []
    ngrams: dict[tuple[int, ...], list[int]] = {}
    for ngram in zip(*[text[i:] for i in range(n)]):
        prev = tuple(ngram[:-1])
        ngrams[prev] = [*ngrams.get(prev, []), ngram[-1]]
    start = cur_len + 1 - n
    return ngrams.get(tuple(text[start:cur_len]), [])


def dry(
    scores: torch.Tensor,
    text: list[int],
    multiplier: float,
    base: float,
    allowed: int,
    last_n: int,
    breakers: list[list[int]],
) -> torch.Tensor:
    """llama.cpp's llama_sampler_dry_apply, with its naive (non-Z) repeat count."""
    out = scores.clone()
    if multiplier == 0.0 or base < 1.0 or last_n == 0:
        return out
    n_last = len(text) if last_n == -1 else min(len(text), last_n)
    if n_last <= allowed:
        return out

    def rat(i: int) -> int:
        return text[len(text) - 1 - i]

    heads: dict[int, list[list[int]]] = {}
    for b in breakers:
        heads.setdefault(b[0], []).append(b[1:])
    rep_limit = n_last
    for i in range(n_last):
        longest = -1
        for tail in heads.get(rat(i), []):
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return out
    count = [0] * n_last
    for k in range(1, n_last):
        n = 0
        while n + k < n_last and rat(n) == rat(n + k):
            n += 1
        count[n_last - 1 - k] = min(n, rep_limit)
    max_repeat: dict[int, int] = {}
    for i in range(n_last - 1):
        if count[i] >= allowed:
            tok = rat(n_last - 2 - i)
            max_repeat[tok] = max(max_repeat.get(tok, 0), count[i])
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    singles = {b[0] for b in breakers if len(b) == 1}
    for tok, length in max_repeat.items():
        if tok in singles or tok >= len(out):
            continue
        exp = length - allowed
        if max_exp > 0 and exp > max_exp:
            exp = max_exp
        out[tok] = out[tok] - torch.tensor(multiplier * base**exp, dtype=torch.float32)
    return out


def mirostat_step(scores: torch.Tensor, mu: float) -> torch.Tensor:
    """The truncated logits of one mirostat v2 step (llama.cpp: sort, cut by surprise, keep >= 1)."""
    p = torch.softmax(scores, dim=-1).tolist()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    size = next((i for i, t in enumerate(order) if p[t] == 0.0 or -math.log2(p[t]) > mu), len(order))
    out = torch.full_like(scores, NEG_INF)
    keep = order[: max(size, 1)]
    out[keep] = scores[keep]
    return out


def mirostat_update(truncated: torch.Tensor, token: int, mu: float, tau: float, eta_: float) -> float:
    observed = -math.log2(torch.softmax(truncated.double(), dim=-1)[token].item())
    return mu - eta_ * (observed - tau)
