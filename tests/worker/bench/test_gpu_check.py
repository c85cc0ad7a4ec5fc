"""`make gpu-check`: the smoke run (the same script at tiny shapes, on CPU) passes and prints its
one table; without a CUDA device the plain run says so in one line and exits 2; the make target
runs from the source tree with the system python where no .venv exists (a GPU host's torch)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from worker.bench.gpu_check import DECODE_VARIANTS, main

REPO = Path(__file__).resolve().parents[3]
CHECKS = (
    "fp32 greedy = transformers generate() | ok",
    "bf16 top-1 agreement with transformers | ok",
    "seeded runs, two fresh engines | ok",
    "| KV pool |",
    *(f"| engine start-up, {v} |" for v in DECODE_VARIANTS),
    *(f"| decode batch {b} (48 context), {v} |" for b in (1, 4, 8) for v in DECODE_VARIANTS),
)


def test_smoke_run_passes_and_prints_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--smoke"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].startswith("gpu-check on CPU (smoke)") and lines[1] == "| check | result | detail |"
    assert all(line.startswith("|") for line in lines[1:]) and len(lines) == 3 + 6 + 4 * len(DECODE_VARIANTS)
    assert "| fails |" not in out
    for check in CHECKS:
        assert check in out, check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the plain run is the full check")
def test_without_cuda_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "no CUDA device" in captured.err


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_target_uses_the_system_python_without_a_venv() -> None:
    def dry(*args: str) -> str:
        cmd = ["make", "-s", "-n", "-C", str(REPO), "gpu-check", "PYTHONPATH=", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()

    assert dry("BIN=/no/venv", "ARGS=--smoke") == "PYTHONPATH=. python3 -m worker.bench.gpu_check --smoke"
    assert dry("BIN=/no/venv", "PY=/usr/bin/python3.12") == "PYTHONPATH=. /usr/bin/python3.12 -m worker.bench.gpu_check"
