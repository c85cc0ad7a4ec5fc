"""Weights load straight onto the device (issue 20, bug 5), and ``dtype: auto`` runs a float32
checkpoint in bfloat16 on a GPU, float16 where it lacks bfloat16 (bug 6). CPU is unchanged."""

from __future__ import annotations

import logging

import pytest
import torch

from worker.model.loader import auto_dtype, from_pretrained_kwargs, load_dtype, load_model

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def test_weights_load_onto_the_accelerator_not_through_host_ram() -> None:
    assert from_pretrained_kwargs(CUDA, torch.bfloat16) == {"dtype": torch.bfloat16, "device_map": CUDA}
    assert from_pretrained_kwargs(torch.device("cuda:0"), "auto")["device_map"] == torch.device("cuda:0")
    assert from_pretrained_kwargs(CPU, "auto") == {"dtype": "auto"}  # CPU as before


def test_transformers_accepts_the_device_map_the_loader_passes() -> None:
    """transformers refuses any ``device_map`` when accelerate is missing (a ValueError at the
    first CUDA load, which no CPU load reaches): run its own check on what the loader passes."""
    from transformers.integrations.accelerate import check_and_set_device_map

    for device in (CUDA, torch.device("cuda:0")):
        device_map = from_pretrained_kwargs(device, torch.bfloat16)["device_map"]
        assert check_and_set_device_map(device_map) == {"": device}


@pytest.mark.parametrize(
    ("checkpoint", "device", "bf16", "runs_in"),
    [
        (torch.float32, CUDA, True, torch.bfloat16),
        (torch.float32, CUDA, False, torch.float16),  # e.g. a V100 or T4
        (None, CUDA, True, torch.bfloat16),  # no dtype in the config: float32, as vLLM reads it
        (torch.float16, CUDA, True, torch.float16),
        (torch.bfloat16, CUDA, True, torch.bfloat16),
        (torch.float32, CPU, False, torch.float32),
    ],
)
def test_auto_dtype(checkpoint, device, bf16, runs_in) -> None:
    assert auto_dtype(checkpoint, device, bf16) == runs_in


def test_auto_on_a_gpu_is_resolved_and_said_at_start_up(tiny_model_dir, monkeypatch, caplog) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)  # a float32 checkpoint
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    with caplog.at_level(logging.INFO, logger="worker.model.loader"):
        assert load_dtype("auto", config, CUDA) == torch.bfloat16
    assert any("dtype auto: a float32 checkpoint runs in bfloat16 on cuda" in r.getMessage() for r in caplog.records)
    assert load_dtype("float32", config, CUDA) == torch.float32  # an explicit dtype stays
    assert load_dtype("auto", config, CPU) == "auto"  # transformers resolves it on CPU, as before


def test_auto_on_cpu_keeps_the_checkpoint_dtype(tiny_model_dir) -> None:
    assert load_model(tiny_model_dir, device="cpu", dtype="auto").dtype == torch.float32
