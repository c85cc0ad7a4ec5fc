"""The suite runs on CPU where a GPU is visible, unless LOGITPOOL_TEST_DEVICE=cuda asks (issue
20, bug 3): it used to take "cuda if available", each engine sizing its pool from the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.worker.model_fixtures import (
    DEVICE_ENV,
    GPU_KV_CACHE_BYTES,
    engine_config,
    suite_device,
    suite_engine_kwargs,
    tiny_model_path,
)
from worker.model.loader import load_model


def test_the_suite_stays_on_cpu_where_cuda_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert suite_device() == "cpu" and suite_engine_kwargs() == {}
    # What the session fixture does: a real load, on CPU (the old default would have gone to CUDA).
    assert load_model(tiny_model_path(), device=suite_device(), dtype="float32").device.type == "cpu"
    assert engine_config(max_num_seqs=2).kv_cache_bytes is None  # CPU: max_num_seqs x max_model_len


def test_cuda_on_request_gives_every_engine_an_explicit_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert suite_device() == "cuda"
    cfg = engine_config(max_num_seqs=2)
    assert cfg.kv_cache_bytes == GPU_KV_CACHE_BYTES and cfg.device == "cuda"
    assert engine_config(kv_cache_bytes=4096).kv_cache_bytes == 4096  # a test's own pool wins
