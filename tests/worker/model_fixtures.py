"""The tiny real model for tests: built once (cached on disk across sessions), loaded once per session.

Import the fixtures into a test module (``from tests.worker.model_fixtures import tiny_model``)
or a conftest. The cache dir is ``$LOGITPOOL_CACHE`` or ``~/.cache/logitpool``;
``build_tiny_model``'s marker file makes a rebuild happen only when the recipe changes.

The suite runs on CPU, also where a GPU is visible, unless ``LOGITPOOL_TEST_DEVICE=cuda`` asks
for it; then every test engine gets an explicit KV pool (``engine_config`` /
``suite_engine_kwargs``): sized from the device, each engine would take most of the GPU.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

from worker.config import EngineConfig
from worker.model.loader import LoadedModel, embedded_model_path, load_model

DEVICE_ENV = "LOGITPOOL_TEST_DEVICE"
# The KV pool of each test engine on a GPU: far more than any test's requests need.
GPU_KV_CACHE_BYTES = 256 * 2**20


def suite_device() -> str:
    """Where the suite's models run: ``$LOGITPOOL_TEST_DEVICE``, else CPU (never "cuda if available")."""
    return os.environ.get(DEVICE_ENV) or "cpu"


def suite_engine_kwargs() -> dict[str, Any]:
    """Engine fields every test engine takes: an explicit KV pool off the CPU (none on CPU, where
    the pool is max_num_seqs x max_model_len as in production)."""
    return {} if suite_device() == "cpu" else {"device": suite_device(), "kv_cache_bytes": GPU_KV_CACHE_BYTES}


def engine_config(**kw: Any) -> EngineConfig:
    """``EngineConfig(**kw)`` for a test engine on the suite's device."""
    return EngineConfig(**{**suite_engine_kwargs(), **kw})


@functools.cache
def tiny_model_path() -> Path:
    return embedded_model_path()


@functools.cache
def tiny_loaded() -> LoadedModel:
    """float32 on the suite's device; shared by every test of the session."""
    return load_model(tiny_model_path(), device=suite_device(), dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model_path()


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return tiny_loaded()
