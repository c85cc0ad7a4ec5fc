# Two commands: `make test` and `make serve` (flags in ARGS="..."). Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv lint test serve bench clean protos helm-schema

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: 2.13.0 is a CPU build on local disk; the project's range then pulls nothing more.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[serve,client,dev]"
	touch $(STAMP)

# ruff (lint, then format) and mypy, all configured in pyproject.toml. mypy keeps .mypy_cache
# (git-ignored): a cold run, as in CI, reads torch and ray (about 30 s of CPU), a warm one a few seconds.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# `make lint` first, so a lint or type error fails `make test` (and .ci/run) before any test runs.
# The suite's own Ray clusters run without token auth (tests/conftest.py says why).
test: venv lint
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q

serve: venv
	$(BIN)/logitpool serve $(ARGS)

bench: venv
	$(BIN)/logitpool bench sampler

# The GPU check (worker/bench/gpu_check.py). No venv target: on a GPU host without .venv it runs
# the system python from the source tree, so the host's own torch is used and nothing installed.
GPU_CHECK_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=.$(if $(PYTHONPATH),:$(PYTHONPATH)) $(GPU_CHECK_PY) -m worker.bench.gpu_check $(ARGS)

protos: venv
	$(BIN)/python protos/generate.py

# The Helm values schema, generated from the config model (tests/cluster_rayfree/test_helm_schema.py checks it).
helm-schema: venv
	$(BIN)/python -m cluster.deploy.helm_schema

clean:
	rm -rf $(VENV)
