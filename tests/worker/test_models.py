"""build_tiny_model and load_model, on real files through the real Hugging Face loading path."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from worker.model.loader import LoadedModel, build_tiny_model, default_model_path, load_model, unsupported_reason

SMALL = {"vocab_size": 600, "hidden_size": 64, "num_layers": 1, "intermediate_size": 128}


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_build_is_deterministic_per_seed(tmp_path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=3, **SMALL)
    b = build_tiny_model(tmp_path / "b", seed=3, **SMALL)
    c = build_tiny_model(tmp_path / "c", seed=4, **SMALL)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()  # seed is weights only


def test_build_is_idempotent_and_rebuilds_on_other_args(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "m", seed=0, **SMALL)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    before = _weights(path)["lm_head.weight"]
    assert build_tiny_model(path, seed=0, **SMALL) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    build_tiny_model(path, seed=1, **SMALL)
    assert json.loads((path / "logitpool_tiny_model.json").read_text())["seed"] == 1
    assert not torch.equal(_weights(path)["lm_head.weight"], before)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp build dirs left behind


def test_build_refuses_to_overwrite_a_foreign_directory(tmp_path) -> None:
    (tmp_path / "keep.txt").write_text("not a model")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        build_tiny_model(tmp_path, **SMALL)
    assert (tmp_path / "keep.txt").read_text() == "not a model"


def test_default_model_path_follows_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LOGITPOOL_CACHE", str(tmp_path))
    assert default_model_path() == tmp_path / "tiny-llama"


def test_tiny_model_facts(tiny_model: LoadedModel) -> None:
    cfg, tok = tiny_model.config, tiny_model.tokenizer
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 4, 8, 4)
    assert tiny_model.vocab_size == cfg.vocab_size == len(tok)
    assert 2000 <= len(tok) <= 4000
    assert tiny_model.eos_token_ids == {tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")}
    assert tiny_model.max_model_len == 2048
    assert tiny_model.dtype == torch.float32
    assert 0.08 < float(tiny_model.model.model.layers[0].self_attn.q_proj.weight.detach().std()) < 0.12
    assert tok.pad_token_id is not None and tok.pad_token_id not in tiny_model.eos_token_ids


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80).filter(lambda t: "<|" not in t))
def test_tokenizer_round_trips_text(tiny_model: LoadedModel, text: str) -> None:
    ids = tiny_model.tokenizer(text)["input_ids"]
    assert ids[0] == tiny_model.tokenizer.bos_token_id
    assert max(ids) < tiny_model.vocab_size
    assert tiny_model.tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders_roles(tiny_model: LoadedModel) -> None:
    text = tiny_model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_greedy_text_varies_across_prompts(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    prompts = ["def parse(self, text):", "import json\n", "class Shape:\n    def area", "The result is"]
    continuations = set()
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids.to(tiny_model.device)
        out = tiny_model.model.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        new = out[0, ids.shape[1] :].tolist()
        assert len(set(new)) > 1  # not a one-token loop
        continuations.add(tuple(new))
    assert len(continuations) == len(prompts)


def test_load_model_dtype_and_device(tiny_model: LoadedModel) -> None:
    path = tiny_model.model.name_or_path
    bf16 = load_model(path, device="cpu", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.device == torch.device("cpu")
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_model(path, dtype="float8")


def test_sliding_windows_and_softcapping_are_accepted() -> None:
    """The block attention masks per-layer windows and softcaps (tests/worker/test_model_matrix.py)."""
    import transformers

    assert unsupported_reason(transformers.MistralConfig(sliding_window=16)) is None
    assert unsupported_reason(transformers.Gemma2Config()) is None
    assert unsupported_reason(transformers.Gemma3TextConfig()) is None


def test_load_model_refuses_a_model_outside_the_attention_interface(tmp_path) -> None:
    """Bloom (ALiBi) has a clean config but bypasses AttentionInterface: caught on the model class."""
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(vocab_size=100, hidden_size=32, n_layer=1, n_head=4)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="_supports_attention_backend is False"):
        load_model(tmp_path, device="cpu")


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        (lambda t: t.DeepseekV3Config(), "latent attention"),
        (lambda t: t.Qwen3NextConfig(), "linear_attention"),
        (lambda t: t.Llama4TextConfig(), "chunked_attention"),
        (lambda t: t.Qwen2VLConfig(), "multimodal"),
        (
            lambda t: t.Qwen2Config(
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [16, 24, 24]}
            ),
            "mrope",
        ),
    ],
)
def test_unsupported_reason_names_the_feature(factory, reason: str) -> None:
    import transformers

    assert reason in unsupported_reason(factory(transformers))


@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen2Config", "Phi3Config"])
def test_plain_full_attention_configs_are_accepted(name: str) -> None:
    import transformers

    assert unsupported_reason(getattr(transformers, name)()) is None
    assert unsupported_reason(transformers.MistralConfig(sliding_window=None)) is None
