"""The library through the real engine: loaded as entry points, argmax invariance honoured."""

from __future__ import annotations

import pytest
import torch

from tests.worker.library import references as ref
from tests.worker.test_engine import make_llm, prompts_of
from worker import SamplingParams
from worker.logits_processor.library import LIBRARY_PROCESSORS


def test_every_library_processor_loads_through_its_entry_point(tiny_model) -> None:
    llm = make_llm(tiny_model, load_entry_points=True)
    loaded = {type(p) for p in llm.engine.processors.all}
    assert set(LIBRARY_PROCESSORS) <= loaded
    invariant = {type(p) for p in llm.engine.processors.argmax_invariant}
    assert {c.__name__ for c in LIBRARY_PROCESSORS if c in invariant} == {
        "TopALogitsProcessor",
        "EpsilonLogitsProcessor",
        "EtaLogitsProcessor",
        "MirostatLogitsProcessor",
    }


def test_no_repeat_ngram_in_an_all_greedy_batch_equals_transformers(tiny_model) -> None:
    """Not argmax-invariant, so it runs although every row is greedy: token for token HF's generate."""
    llm = make_llm(tiny_model, load_entry_points=True)
    prompts = prompts_of(tiny_model, 2, lo=4, hi=12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, extra_args={"no_repeat_ngram_size": 2})
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device=tiny_model.device)
        with torch.inference_mode():
            hf = tiny_model.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                no_repeat_ngram_size=2,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == hf[0, len(prompt) :].tolist()


def test_dry_keeps_a_greedy_request_from_extending_a_repeat(tiny_model) -> None:
    """A penalty of 100 outweighs any logit gap of the tiny model: no chosen token extends a repeat."""
    llm = make_llm(tiny_model, load_entry_points=True)
    prompt = prompts_of(tiny_model, 1, lo=6, hi=7, seed=9)[0] * 5  # a loop: its next token is penalised
    args = {"dry_multiplier": 100.0, "dry_base": 1.0, "dry_allowed_length": 2}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, extra_args=args)
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    zeros = torch.zeros(tiny_model.vocab_size)
    text = list(prompt)
    penalised_steps = 0
    for tok in out:
        penalised = ref.dry(zeros, text, 100.0, 1.0, 2, -1, []) < 0
        penalised_steps += bool(penalised.any())
        assert not penalised[tok]
        text.append(tok)
    assert penalised_steps > 0


def test_sampled_library_requests_run_and_are_reproducible_when_seeded(tiny_model) -> None:
    llm = make_llm(tiny_model, load_entry_points=True)
    prompts = prompts_of(tiny_model, 6, seed=11)
    extras = [
        {"xtc_probability": 0.5, "xtc_threshold": 0.05},
        {"typical_p": 0.8},
        {"top_a": 0.3},
        {"epsilon_cutoff": 0.01, "eta_cutoff": 0.01},
        {"mirostat": 2, "mirostat_tau": 3.0},
        {"dry_multiplier": 0.8, "no_repeat_ngram_size": 3},
    ]
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=6, ignore_eos=True, extra_args=e)
        for i, e in enumerate(extras)
    ]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone
    assert all(len(t) == 6 for t in together)


def test_unknown_extra_args_key_is_rejected_naming_the_known_ones(tiny_model) -> None:
    llm = make_llm(tiny_model, load_entry_points=True)
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'xtc_treshold'.*xtc_threshold"):
        llm.generate([[5, 6]], SamplingParams(extra_args={"xtc_treshold": 0.1}))
    with pytest.raises(ValueError, match=r"extra_args\.typical_p"):
        llm.generate([[5, 6]], SamplingParams(extra_args={"typical_p": 1.5}))
    lax = make_llm(tiny_model, load_entry_points=True, strict_extra_args=False)
    assert (
        len(
            lax.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True, extra_args={"xtc_treshold": 0.1}))[0]
            .outputs[0]
            .token_ids
        )
        == 2
    )
