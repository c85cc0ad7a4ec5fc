"""Fused layers (worker.model.fusion) compute exactly what the unfused model computes, on CPU."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.worker.test_model_matrix import _COMMON, FAMILIES
from worker.model.fusion import FusionCounts, _SharedProjection, fuse_layers
from worker.model.packed_linear import PackedLinear, plain_linear

# Gate/up fuse only on CUDA; passed as the devices, this checks that swap's numbers on CPU.
GATE_UP_ON_CPU = frozenset({"cpu"})


def _family_model(name: str, vocab: int = 97) -> nn.Module:
    import transformers

    cls_name, extra = FAMILIES[name]
    kw = {**_COMMON, **extra} if name != "gpt2" else {"initializer_range": 0.1, **extra}
    config: Any = getattr(transformers, cls_name)(vocab_size=vocab, **kw)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if hasattr(config, "num_hidden_layers"):  # bias on q/k/v (Qwen2) stays random too
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.normal_(m.bias, std=0.1)
    return model


@pytest.mark.parametrize("mlp_on_cpu", [True, False], ids=["gate_up_too", "as_on_cpu"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_gives_bitwise_the_same_logits(family: str, mlp_on_cpu: bool) -> None:
    """Both what CPU runs (q/k/v only) and the gate/up swap CUDA adds, checked here on CPU."""
    model = _family_model(family)
    fused = copy.deepcopy(model)
    counts = fuse_layers(fused, mlp_devices=GATE_UP_ON_CPU) if mlp_on_cpu else fuse_layers(fused)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        got = fused(input_ids=ids).logits
    assert torch.equal(got, want), family
    assert fused.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    layers = _COMMON["num_hidden_layers"]
    if family in ("llama", "mistral", "mistral_window", "qwen2", "qwen3", "granite", "smollm3"):
        # Llama's RMSNorm and gated MLP, and three q/k/v Linears, in every layer.
        mlps = layers if mlp_on_cpu else 0  # gate/up: CUDA only unless asked (one wider GEMM is slower in MKL)
        assert counts.mlps == mlps and counts.qkv == layers and counts.norms == 0, counts  # norms: CUDA only
    if family == "gpt2":  # fused c_attn, Conv1D, LayerNorm: nothing of the kind to fuse
        assert counts == FusionCounts()


def test_fusing_twice_changes_nothing_and_weights_are_views() -> None:
    model = _family_model("llama")
    first = fuse_layers(model, mlp_devices=GATE_UP_ON_CPU)
    assert first.mlps > 0 and first.qkv > 0
    assert fuse_layers(model, mlp_devices=GATE_UP_ON_CPU) == FusionCounts()
    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj.weight, attn.k_proj.weight
    # One copy of the weights: k's rows follow q's in the same storage.
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert first.describe().startswith(f"{first.norms} RMSNorms")


def test_the_engine_runs_fused_by_default_and_the_tokens_match_unfused(tiny_model) -> None:
    from tests.worker.model_fixtures import engine_config
    from worker.engine import LLMEngine
    from worker.model.loader import load_model
    from worker.sampling_params import SamplingParams

    prompts = [[5, 9, 33, 41, 7, 8], [100, 200, 300], list(range(20, 45))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=12, ignore_eos=True, logprobs=3),
    ]
    runs = []
    for fused in (True, False):
        loaded = load_model(tiny_model.model.name_or_path, device="cpu", dtype="float32")
        engine = LLMEngine(engine_config(fused_layers=fused), loaded=loaded)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        runs.append({rid: (list(o.token_ids), o.cumulative_logprob) for rid, o in done.items()})
        attn = loaded.model.model.layers[0].self_attn
        swapped = vars(attn.q_proj).get("forward")  # fused: a slice of the shared q/k/v GEMM
        assert (swapped is not None and not isinstance(swapped, PackedLinear)) is fused
    assert runs[0] == runs[1]


@settings(max_examples=60, deadline=None)
@given(
    order=st.lists(st.integers(0, 2), min_size=1, max_size=9),
    inputs=st.lists(st.integers(0, 2), min_size=9, max_size=9),
    bias=st.booleans(),
    mutate_at=st.integers(-1, 8),
)
def test_shared_projection_equals_three_linears_in_any_call_order(
    order: list[int], inputs: list[int], bias: bool, mutate_at: int
) -> None:
    """Each call gives its own Linear's output on the input it is given, whatever came before:
    other inputs, repeated slices, or the same tensor changed in place in between."""
    g = torch.Generator().manual_seed(len(order))
    sizes = [6, 4, 4]
    weights = [torch.randn(n, 8, generator=g) for n in sizes]
    biases = [torch.randn(n, generator=g) if bias else None for n in sizes]
    shared = _SharedProjection(plain_linear(torch.cat(weights), torch.cat(biases) if bias else None), sizes)  # type: ignore[arg-type]
    xs = [torch.randn(3, 8, generator=g) for _ in range(3)]
    for step, index in enumerate(order):
        x = xs[inputs[step]]
        if step == mutate_at:
            x.mul_(2.0)
        want = F.linear(x, weights[index], biases[index])
        assert torch.equal(shared.take(index, x), want)


@settings(max_examples=40, deadline=None)
@given(
    width=st.sampled_from([8, 24, 64, 100, 768, 4096]),
    rows=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_the_cuda_rms_norm_swap_computes_llamas_norm(width: int, rows: int, dtype: torch.dtype) -> None:
    """The swap runs on CUDA only (a fused kernel there); its formula is checked here, on CPU,
    against transformers' own LlamaRMSNorm (bitwise on CPU, where rms_norm is composed of ops)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from worker.model.fusion import _rms_norm

    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(width))
    x = (3 * torch.randn(1, rows, width, generator=torch.Generator().manual_seed(rows))).to(dtype)
    assert torch.equal(_rms_norm(norm)(x), norm(x))
