"""A plain, per-row reference of every sampler step (docs/sampling.md "The nine steps"): loops, sorts, no cleverness.

Each function takes ONE row (a 1-D float32 tensor) and returns a new one. Float formulas are
the same elementwise operations the batched code uses, so masks compare exactly and floats
bit-for-bit, except where noted (top-p sums, which tests keep away from the boundary).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from worker.sampling_params import SamplingParams

NEG_INF = float("-inf")


def allowed(row: torch.Tensor, ids: Sequence[int] | None) -> torch.Tensor:
    if ids is None:
        return row.clone()
    out = torch.full_like(row, NEG_INF)
    for t in ids:
        out[t] = row[t]
    return out


def bad_words(row: torch.Tensor, words: Sequence[Sequence[int]], output: Sequence[int]) -> torch.Tensor:
    out = row.clone()
    for w in words:
        prefix = list(w[:-1])
        n = len(prefix)
        if n == 0 or (len(output) >= n and list(output[len(output) - n :]) == prefix):
            out[w[-1]] = NEG_INF
    return out


def min_tokens(row: torch.Tensor, minimum: int, stops: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    out = row.clone()
    if len(output) < minimum:
        for t in stops:
            out[t] = NEG_INF
    return out


def logit_bias(row: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    out = row.clone()
    for t, b in (bias or {}).items():
        out[t] = out[t] + torch.tensor(b, dtype=torch.float32)
    return out


def penalties(
    row: torch.Tensor, prompt: Sequence[int], output: Sequence[int], rep: float, freq: float, pres: float
) -> torch.Tensor:
    out = row.clone()
    r = torch.tensor(rep, dtype=torch.float32)
    if rep != 1.0:
        for t in sorted(set(prompt) | set(output)):
            x = out[t]
            out[t] = x / r if x > 0 else x * r
    f = torch.tensor(freq, dtype=torch.float32)
    p = torch.tensor(pres, dtype=torch.float32)
    for t in sorted(set(output)):
        count = torch.tensor(float(output.count(t)), dtype=torch.float32)
        out[t] = out[t] - f * count
        out[t] = out[t] - p * torch.tensor(1.0)
    return out


def min_p(row: torch.Tensor, mp: float) -> torch.Tensor:
    """Logit-space form of 'prob < min_p * max_prob': x < max + log(min_p) (log in float64, then float32)."""
    if mp <= 0.0:
        return row.clone()
    threshold = row.max() + torch.tensor(math.log(mp), dtype=torch.float32)
    out = row.clone()
    for t in range(row.numel()):
        if row[t] < threshold:
            out[t] = NEG_INF
    return out


def order(values: torch.Tensor) -> list[int]:
    """Token ids by value descending, equal values by id ascending."""
    vals = values.tolist()
    return sorted(range(len(vals)), key=lambda i: (-vals[i], i))


def top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= row.numel():
        return row.clone()
    out = torch.full_like(row, NEG_INF)
    for t in order(row)[:k]:
        out[t] = row[t]
    return out


def top_p_kept(row: torch.Tensor, p: float) -> list[int]:
    """Ids kept by top-p, plus (as a check helper) nothing else: the smallest prefix reaching p."""
    probs = torch.softmax(row[None], -1)[0]
    ids = order(probs)
    vals = [float(probs[i]) for i in ids]
    total = sum(vals)
    kept, before = [], 0.0
    for i, v in zip(ids, vals):
        if before < p * total:
            kept.append(i)
        before += v
    return kept


def top_p_margin(row: torch.Tensor, p: float) -> float:
    """Distance of ``p * total`` from every prefix mass: tests skip rows closer than float noise."""
    probs = torch.softmax(row[None], -1)[0].double()
    vals = [float(probs[i]) for i in order(probs.float())]
    total = sum(vals)
    run, best = 0.0, math.inf
    for v in vals:
        run += v
        best = min(best, abs(run - p * total))
    return best


def top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return row.clone()
    out = torch.full_like(row, NEG_INF)
    for t in top_p_kept(row, p):
        out[t] = row[t]
    return out


def greedy_token(row: torch.Tensor) -> int:
    return order(row)[0]


def before_temperature(
    row: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """Steps 3-6 on one row."""
    x = allowed(row.float(), params.allowed_token_ids)
    x = bad_words(x, params.bad_words_token_ids, output)
    x = min_tokens(x, params.min_tokens, sorted(params.all_stop_token_ids), output)
    x = logit_bias(x, params.logit_bias)
    if params.uses_penalties:
        x = penalties(x, prompt, output, params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    return x


def processed(
    row: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    top_p_value: float | None = None,
) -> torch.Tensor:
    """Logits after step 7c of one row (greedy rows: after step 6)."""
    x = before_temperature(row, params, prompt, output)
    if params.is_greedy:
        return x
    x = x / torch.tensor(params.temperature, dtype=torch.float32)
    x = min_p(x, params.min_p)
    x = top_k(x, params.top_k)
    p = float(torch.tensor(params.top_p, dtype=torch.float32)) if top_p_value is None else top_p_value
    return top_p(x, p)


def distribution(
    row: torch.Tensor, params: SamplingParams, prompt: Sequence[int] = (), output: Sequence[int] = ()
) -> torch.Tensor:
    """The probabilities step 7d must draw from (float64)."""
    return torch.softmax(processed(row, params, prompt, output).double(), -1)


PROBE = 64  # top-p rows whose nucleus ends inside their top 64 tokens draw in top-p order


def draw_sequence(
    row: torch.Tensor, params: SamplingParams, prompt: Sequence[int] = (), output: Sequence[int] = ()
) -> tuple[list[int], list[float]]:
    """Step 7d's candidates of one random row, in the order the inverse CDF walks them, with weights.

    Top-k rows: the k kept tokens' own softmax, in top-p order (probability desc, id asc), top-p
    applied to that. Other rows: the full row's softmax; with top-p, the nucleus, walked in top-p
    order when it fits the top 64 (strictly above the 65th probability), else by id; without, by id.
    """
    x = before_temperature(row, params, prompt, output)
    x = min_p(x / torch.tensor(params.temperature, dtype=torch.float32), params.min_p)
    v = x.numel()
    p = float(torch.tensor(params.top_p, dtype=torch.float32))
    if 0 < params.top_k < v:
        ids = order(x)[: params.top_k]
        q = torch.softmax(x[ids][None], -1)[0]
        seq = [ids[i] for i in order(q)]
        w = [float(q[ids.index(t)]) for t in seq]
        if p < 1.0:
            total, before, n = sum(w), 0.0, 0
            for wi in w:
                if not before < p * total:
                    break
                before, n = before + wi, n + 1
            seq, w = seq[:n], w[:n]
        return seq, w
    probs = torch.softmax(x[None], -1)[0]
    if p >= 1.0:
        return list(range(v)), probs.double().tolist()
    kept = top_p_kept(x, p)
    ranked = order(probs)
    fits = len(kept) <= PROBE and (v <= PROBE or float(probs[kept[-1]]) > float(probs[ranked[PROBE]]))
    seq = kept if fits else sorted(kept)
    return seq, [float(probs[t]) for t in seq]


def inverse_cdf(seq: Sequence[int], weights: Sequence[float], u: float) -> tuple[int, float]:
    """(the token where the running sum of ``weights`` first exceeds ``u * total``, the distance of
    that target from the nearest boundary relative to the total: callers skip rows within float noise)."""
    total = sum(weights)
    t, run = u * total, 0.0
    for tok, w in zip(seq, weights):
        if w > 0 and run + w > t:
            return tok, min(t - run, run + w - t) / total
        run += w
    last = max(i for i, w in enumerate(weights) if w > 0)
    return seq[last], 0.0


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of drawn ``tokens`` against ``probs``; fails outright on a zero-probability draw.

    Tokens expected fewer than 5 times are pooled into one bin (the test's validity condition).
    """
    from scipy.stats import chisquare

    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * tokens.numel()
    assert counts[expected == 0].sum() == 0, "a zero-probability token was drawn"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # fold a too-small pool into the smallest regular bin
        obs, exp = obs[:-1], exp[:-1]
        j = int(torch.argmin(exp))
        obs[j] += counts[~big].sum()
        exp[j] += expected[~big].sum()
    if obs.numel() < 2:
        return 1.0
    exp = exp * (obs.sum() / exp.sum())
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@st.composite
def logit_rows(draw: st.DrawFn, n: int, v: int, allow_neg_inf: bool = True) -> torch.Tensor:
    """[n, v] float32 rows mixing the hard cases: many equal values, a single peak, -inf holes."""
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["ties", "peak", "normal", "few_levels"]))
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        x = torch.zeros(n, v)
    elif kind == "peak":
        x = torch.zeros(n, v)
        x[torch.arange(n), torch.randint(0, v, (n,), generator=g)] = 3.0
    elif kind == "few_levels":
        x = torch.randint(-2, 3, (n, v), generator=g).float()
    else:
        x = torch.randn(n, v, generator=g)
    if allow_neg_inf and draw(st.booleans()):
        holes = torch.rand(n, v, generator=g) < 0.3
        x = x.masked_fill(holes, float("-inf"))
        x[:, 0] = torch.where(torch.isinf(x[:, 0]), 0.0, x[:, 0])  # keep a finite logit per row
    return x
