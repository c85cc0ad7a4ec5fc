"""One tiny random model per supported family, through the engine, equal to generate() greedily.

Each model is built from its config (real transformers classes, saved and loaded through the
real loading path), then served by an engine whose KV pool is tight enough to preempt and whose
requests share a prompt prefix (prefix-cache hits). Families with sliding windows (Mistral-7B
style, Gemma 2/3 local layers interleaved with global ones) use a window shorter than the
prompts, so the window really masks; Gemma 2 also softcaps attention logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.worker.test_engine import hf_greedy
from tests.worker.test_paged_engine import _engine, _run
from worker.model import cascade as attention_cascade
from worker.model.loader import LoadedModel, load_model
from worker.sampling_params import SamplingParams

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
WINDOW = 12

# family -> (config class name, extra kwargs); every one goes through AutoModelForCausalLM.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"head_dim": 24}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", {"sliding_window": WINDOW}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 16, "sliding_window": WINDOW, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "smollm3": ("SmolLM3Config", {"pad_token_id": 0}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64, "num_key_value_heads": None}),
}


def _build(name: str, tmp_path, tokenizer) -> LoadedModel:
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, extra = FAMILIES[name]
    kw = {**_COMMON, **extra} if name != "gpt2" else {"initializer_range": 0.1, **extra}
    config: Any = getattr(transformers, cls_name)(vocab_size=len(tokenizer), **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return load_model(tmp_path, device="cpu", dtype="float32")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_greedy_equals_generate(family: str, tmp_path, tiny_model: LoadedModel, monkeypatch) -> None:
    # Cascade attention on for any shared prefix (not only where it pays), so every family runs it.
    monkeypatch.setattr(attention_cascade, "MIN_ROWS", 2)
    monkeypatch.setattr(attention_cascade, "MIN_SAVED_TOKENS", 1)
    loaded = _build(family, tmp_path, tiny_model.tokenizer)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(10, 2900, (24,), generator=g).tolist()
    prompts = [prefix + torch.randint(10, 2900, (int(n),), generator=g).tolist() for n in (5, 9, 3, 14, 7)]
    prompts[1] = list(prompts[0])
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)) for p in prompts]
    engine = _engine(loaded, blocks=14, block_size=4, max_num_batched_tokens=24)
    done = _run(engine, reqs, stagger=1)
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert engine.runner.num_cascade_steps > 0, "decode rows sharing the prefix must take the cascade path"
    # The oracle: the same checkpoint loaded separately with transformers' eager attention.
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    oracle = LoadedModel(
        eager,
        *[
            getattr(loaded, f)
            for f in ("tokenizer", "config", "eos_token_ids", "vocab_size", "max_model_len", "device", "dtype")
        ],
    )
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].outputs[0].token_ids == hf_greedy(oracle, p, 10)[0], f"{family} request {i}"
        if i < 2:  # the fallback path on the served model object agrees too
            assert hf_greedy(loaded, p, 10)[0] == hf_greedy(oracle, p, 10)[0]


def test_the_window_really_masks(tmp_path, tiny_model: LoadedModel) -> None:
    """A windowed Mistral's logits differ from the same weights without a window (the test above bites)."""
    loaded = _build("mistral_window", tmp_path, tiny_model.tokenizer)
    ids = torch.arange(100, 140)[None]
    with torch.inference_mode():
        windowed = loaded.model(input_ids=ids).logits[0, -1]
        loaded.model.config.sliding_window = None
        for layer in loaded.model.model.layers:
            layer.self_attn.config.sliding_window = None
        full = loaded.model(input_ids=ids).logits[0, -1]
    assert not torch.allclose(windowed, full, atol=1e-3)
