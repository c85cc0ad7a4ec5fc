"""Packed linears (worker.model.packed_linear): torch's numbers within float32 rounding, taken
only where asked (a runner's forward, this thread, decode-sized calls), refused where they
cannot run."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from worker.config import EngineConfig
from worker.model.packed_linear import (
    PACKED_ROWS,
    PackedLinear,
    can_pack,
    pack_linears,
    packed_gemms,
    resolve_packed_weights,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")

PACKED_OP = "mkl::_mkl_linear"


def _ops(fn: Callable[[], object]) -> set[str]:
    """The aten/mkl op names ``fn()`` ran (torch's profiler: which kernel a call took)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300),
    in_features=st.sampled_from([8, 24, 64, 100, 768]),
    out_features=st.sampled_from([1, 16, 97, 256]),
    bias=st.booleans(),
    leading=st.sampled_from([(), (1,), (2,)]),
    seed=st.integers(0, 2**16),
)
def test_packed_equals_f_linear_within_float32_rounding(
    rows: int, in_features: int, out_features: int, bias: bool, leading: tuple[int, ...], seed: int
) -> None:
    """Inside the block: F.linear's values within a few float32 ulps of the reduction; outside
    it: F.linear bitwise (the fallback is F.linear itself)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(*leading, rows, in_features, generator=g)
    linear = PackedLinear(weight, b)
    want = F.linear(x, weight, b)
    with torch.inference_mode():
        with packed_gemms(True):
            got = linear(x)
        outside = linear(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    # |error| of a K-term float32 dot product, reordered: ~K * eps * sum |x_k w_k|.
    scale = F.linear(x.abs(), weight.abs(), None if b is None else b.abs())
    assert bool(((got - want).abs() <= 4 * in_features * 2**-24 * scale + 1e-30).all())
    assert torch.equal(outside, want)


def test_the_packed_kernel_runs_only_at_its_rows_and_inside_the_block() -> None:
    weight = torch.randn(64, 32)
    linear = PackedLinear(weight, None)
    inside = PACKED_ROWS[len(PACKED_ROWS) // 2]
    for rows, on, taken in [
        (inside, True, True),
        (inside, False, False),
        (PACKED_ROWS.start - 1, True, False),
        (PACKED_ROWS.stop, True, False),
    ]:
        x = torch.randn(rows, 32)

        def call(x: torch.Tensor = x, on: bool = on) -> None:
            with torch.inference_mode(), packed_gemms(on):
                linear(x)

        assert (PACKED_OP in _ops(call)) is taken, (rows, on)


def test_the_block_is_per_thread_and_restored() -> None:
    """Another thread's forward (transformers' generate() beside a runner) keeps F.linear."""
    linear = PackedLinear(torch.randn(16, 8), None)
    x = torch.randn(PACKED_ROWS.start, 8)
    seen: list[set[str]] = []
    with packed_gemms(True):
        t = threading.Thread(target=lambda: seen.append(_ops(lambda: linear(x))))
        t.start()
        t.join()
        with packed_gemms(False):
            assert PACKED_OP not in _ops(lambda: linear(x))
        assert PACKED_OP in _ops(lambda: linear(x))  # restored on leaving the inner block
    assert PACKED_OP not in seen[0]
    assert PACKED_OP not in _ops(lambda: linear(x))


def test_pack_linears_swaps_plain_float32_linears_once() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_linears(model) == 2  # the bf16 one is left to F.linear
    assert pack_linears(model) == 0
    assert "forward" not in vars(model[3])
    x = torch.randn(PACKED_ROWS.start, 8)
    with torch.inference_mode():
        want = model[2](F.relu(F.linear(x, model[0].weight, model[0].bias)))  # module 2 runs its swap, outside
        with packed_gemms(True):
            got = model[:3](x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_field_resolves_per_device_and_dtype_and_refuses_where_it_cannot_run() -> None:
    cpu = torch.device("cpu")
    assert EngineConfig().packed_weights is False
    assert resolve_packed_weights(True, cpu, torch.float32) is torch.backends.mkl.is_available()
    assert resolve_packed_weights(False, cpu, torch.float32) is False
    assert resolve_packed_weights(False, torch.device("cuda"), torch.bfloat16) is False
    with pytest.raises(ValueError, match=r"^packed_weights: .*bfloat16"):
        resolve_packed_weights(True, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match=r"^packed_weights: .*cuda"):
        resolve_packed_weights(True, torch.device("cuda"), torch.float32)
    assert not can_pack(torch.zeros(3, 3, dtype=torch.float16)) and not can_pack(torch.zeros(3))
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match=re.escape("packed_weights: must be bool")):
            EngineConfig(packed_weights=bad)  # type: ignore[arg-type]


def _greedy_run(loaded: Any, **fields: Any) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Three greedy requests to the end; their tokens and each step's logits."""
    from tests.worker.model_fixtures import engine_config
    from worker.engine import LLMEngine
    from worker.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(**fields), loaded=loaded)
    logits: list[torch.Tensor] = []
    execute = engine.executor.runner.execute

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = execute(*args, **kwargs)
        logits.append(out.clone())
        return out

    engine.executor.runner.execute = recording  # type: ignore[method-assign]
    prompts = [list(range(5, 5 + n)) for n in (6, 9, 13, 4)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens, logits


def test_the_engine_packs_when_asked_and_leaves_transformers_own_forward_alone(tiny_model_dir: Path) -> None:
    """An engine with packed_weights=True takes the packed kernel in its decode steps, within
    float32 rounding of the default (which takes none), and transformers' generate() on the very model
    object the engine swapped gives bitwise what it gave before."""
    from worker.model.loader import load_model

    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    ids = torch.tensor([[5, 9, 33, 41, 7, 8, 100, 200]])
    with torch.inference_mode():
        before = loaded.model(input_ids=ids.repeat(4, 1)).logits
    plain_tokens, plain_logits = _greedy_run(loaded)
    packed_tokens, packed_logits = _greedy_run(loaded, packed_weights=True)
    assert PACKED_OP in _ops(lambda: _greedy_run(loaded, packed_weights=True))
    assert PACKED_OP not in _ops(lambda: _greedy_run(loaded))
    assert len(packed_logits) == len(plain_logits)
    # The first step is the four prompts' prefill (32 rows, inside PACKED_ROWS): torch's GEMM,
    # bitwise, so prompt logprobs and the prompts' KV are transformers' numbers.
    assert torch.equal(packed_logits[0], plain_logits[0])
    for got, want in zip(packed_logits, plain_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert packed_tokens == plain_tokens
    with torch.inference_mode():
        after = loaded.model(input_ids=ids.repeat(4, 1)).logits
    assert torch.equal(after, before)


def test_only_decode_steps_are_packed() -> None:
    from worker.model.runner import ScheduledSeq, decode_only

    decode = ScheduledSeq([0], [7], 3, True)
    assert decode_only([decode, ScheduledSeq([1], [8], 5, True)])
    assert not decode_only([decode, ScheduledSeq([1], [8, 9], 0, True)])  # a prompt chunk rides along
    assert not decode_only([ScheduledSeq([1], [8], 0, True, prompt_logits=1)])  # prompt logprobs asked
    assert decode_only([])


def test_prompt_logprobs_are_the_unpacked_engines_bitwise(tiny_model_dir: Path) -> None:
    """What an evaluation harness scores (prompt logprobs, small prompts inside PACKED_ROWS) is
    the same with packing on and off: prefill steps never take the packed kernel."""
    from worker.llm import LLM
    from worker.sampling_params import SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (5, 40, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    runs = []
    for packed in (False, True):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", packed_weights=packed)
        assert llm.engine.executor.runner.packed_weights is packed
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        runs.append([{t: lp.logprob for t, lp in pos.items()} for o in outs for pos in o.prompt_logprobs or [] if pos])
    assert runs[0] and runs[0] == runs[1]
