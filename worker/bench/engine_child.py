"""One engine build's workload, for `python -m worker.bench.compare` (run as a script): uniform
(N random prompts) or shared (N prompts of one common prefix and ``own`` tokens each, the prefix
run once first so every request starts from the cache, as ``bench engine``'s shared-prefix row).

Run with PYTHONPATH at any checkout of this project, old or new: it imports only
``worker.llm.LLM``, ``worker.model.loader.load_model`` and ``worker.sampling_params.SamplingParams``,
which every version since the slot engine has. Prints one JSON line:
``{"N": {"tok_s": float, "digest": str}}`` (digest: SHA-256 of every output token, in order).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch


def main(spec: dict) -> dict[str, dict]:
    from worker.llm import LLM
    from worker.model.loader import load_model
    from worker.sampling_params import SamplingParams

    torch.set_num_threads(spec["threads"])
    loaded = load_model(spec["model"], dtype="float32")
    llm = LLM(
        loaded=loaded,
        max_num_seqs=max(spec["concurrency"]),
        max_num_batched_tokens=spec["budget"],
        max_model_len=spec["max_model_len"],
        load_entry_points=False,
        **spec["engine"],  # engine fields to A/B (e.g. fused_layers), for this tree only
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["new"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[11] * spec["prompt"]] * 2, warm, use_tqdm=False)
    results = {}
    for n in spec["concurrency"]:
        g = torch.Generator().manual_seed(n)
        if spec["workload"] == "shared":
            prefix = torch.randint(10, loaded.vocab_size, (spec["prompt"],), generator=g).tolist()
            own = spec["own"]
            prompts = [prefix + torch.randint(10, loaded.vocab_size, (own,), generator=g).tolist() for _ in range(n)]
            llm.generate([[*prefix, 11]], warm, use_tqdm=False)  # the prefix in the cache
        else:
            prompts = [torch.randint(10, loaded.vocab_size, (spec["prompt"],), generator=g).tolist() for _ in range(n)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        results[str(n)] = {
            "tok_s": n * spec["new"] / seconds,
            "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
        }
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
