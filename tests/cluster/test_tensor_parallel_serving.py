"""A tensor-parallel worker replica (TP = 2 on CPU: the replica is rank 0, rank 1 a process it
starts, the two in one placement group) served through HTTP and gRPC: the same greedy tokens as
the offline engine at TP = 1; a rank killed mid-request fails that request with 503, and a
replacement replica serves the requests after it."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.serving_helpers import deployed, post
from worker.llm import LLM
from worker.sampling_params import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "tp"
ENGINE = {"tensor_parallel_size": 2, "max_num_seqs": 4, "max_model_len": 256, "dtype": "float32", "device": "cpu"}
PROMPT = "def main():"


@pytest.fixture(scope="module")
def serving(ray_cluster, serve_ports, tiny_model_dir):
    yield from deployed(serve_ports, tiny_model_dir, APP, ENGINE)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc): a replica's rank processes."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _offline_tokens(model_dir, max_tokens: int) -> list[int]:
    llm = LLM(str(model_dir), max_num_seqs=4, max_model_len=256, dtype="float32", device="cpu", load_entry_points=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)


def test_http_and_grpc_equal_tp1(serving, grpc_client, tiny_model_dir) -> None:
    base = f"http://127.0.0.1:{serving.server.http_port}"
    want = _offline_tokens(tiny_model_dir, 12)
    body = {"model": serving.served_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = post(base, {**body, "return_token_ids": True})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want
    out = grpc_client.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert list(out.token_ids) == want


def test_killed_rank_fails_the_request_with_503_and_the_replica_is_replaced(serving) -> None:
    from ray import serve

    base = f"http://127.0.0.1:{serving.server.http_port}"
    handle = serve.get_deployment_handle("LogitpoolWorker", app_name=APP)
    info = handle.info.remote().result(timeout_s=30)
    (rank1,) = info["rank_pids"]
    assert rank1 in _children(info["engine_pid"])  # the engine's process starts the ranks
    body = {"model": serving.served_name, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, base, body, timeout=120)
        time.sleep(1.0)  # the request is decoding
        os.kill(rank1, signal.SIGKILL)
        r = running.result()
    assert r.status_code == 503, r.text[:300]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # Serve replaces the whole replica (both ranks)
        r = post(base, {**body, "max_tokens": 4}, timeout=60)
        if r.status_code == 200:
            break
        time.sleep(2)
    assert r.status_code == 200, r.text[:300]
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    assert _gone(rank1) and not _gone(handle.info.remote().result(timeout_s=30)["rank_pids"][0])
