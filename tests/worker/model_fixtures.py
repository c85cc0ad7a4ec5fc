"""The tiny real model for tests: built once (cached on disk across sessions), loaded once per session.

Import the fixtures into a test module (``from tests.worker.model_fixtures import tiny_model``)
or a conftest. The cache dir is ``$LOGITPOOL_CACHE`` or ``~/.cache/logitpool``;
``build_tiny_model``'s marker file makes a rebuild happen only when the recipe changes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from worker.model.loader import LoadedModel, build_tiny_model, default_model_path, load_model


@functools.cache
def tiny_model_path() -> Path:
    return build_tiny_model(default_model_path())


@functools.cache
def tiny_loaded() -> LoadedModel:
    """float32 on CUDA when available, else CPU; shared by every test of the session."""
    return load_model(tiny_model_path(), dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model_path()


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return tiny_loaded()
