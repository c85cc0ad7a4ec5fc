"""The engine end to end on the real tiny model: greedy equivalence under churn, every sampling
feature through `LLM`, custom processors loaded three ways, failure isolation."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import PLUGIN_SITE
from tests.fixtures.seed_processors import DummyLogitsProcessor, WrappedPerReqLogitsProcessor
from tests.worker.model_fixtures import engine_config, suite_engine_kwargs
from worker import LLM, SamplingParams
from worker.engine import LLMEngine
from worker.outputs import OutputAccumulator

DUMMY_FQCN = "tests.fixtures.seed_processors:DummyLogitsProcessor"


def make_llm(loaded, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("load_entry_points", False)
    return LLM(loaded=loaded, **{**suite_engine_kwargs(), **kw})


def prompts_of(loaded, n: int, lo: int = 5, hi: int = 60, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(10, loaded.vocab_size, (length,), generator=g).tolist())
    return out


def hf_greedy(loaded, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    model = loaded.model
    ids = torch.tensor([prompt], device=loaded.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=max_new,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


@pytest.mark.parametrize("reorder", [False, True], ids=["condense", "swap-reorder"])
def test_greedy_equivalence_under_churn(tiny_model, reorder):
    """Requests of different lengths join mid-flight; condense moves (no reorder policy) or SWAP
    moves (the tail reorder policy, which avoids most condense moves) happen; every request
    equals an independent HF generate(), token for token, logprobs within tolerance."""
    engine = LLMEngine(
        engine_config(max_num_seqs=6, max_num_batched_tokens=48, load_entry_points=False, reorder_batch=reorder),
        loaded=tiny_model,
    )
    prompts = prompts_of(tiny_model, 14, seed=1)
    max_new = [3 + (i * 7) % 17 for i in range(len(prompts))]
    accs: dict[str, OutputAccumulator] = {}
    results = {}

    def add(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_new[i], ignore_eos=True, logprobs=0)
        rid = engine.add_request(f"r{i}", prompts[i], params)
        accs[rid] = OutputAccumulator()

    for i in range(4):
        add(i)
    nxt, steps = 4, 0
    while engine.has_unfinished() or nxt < len(prompts):
        if nxt < len(prompts) and steps % 3 == 2:  # join mid-flight
            add(nxt)
            nxt += 1
        for delta in engine.step():
            out = accs[delta.request_id].add(delta)
            if out.finished:
                results[delta.request_id] = out
        steps += 1
        assert steps < 2000
    if reorder:
        assert engine.num_swaps > 0, "the scenario must exercise SWAP moves"
    else:
        assert engine.num_condense_moves > 0, "the scenario must exercise condense moves"
    for i, prompt in enumerate(prompts):
        out = results[f"r{i}"].outputs[0]
        ref_tokens, ref_logits = hf_greedy(tiny_model, prompt, max_new[i])
        assert out.token_ids == ref_tokens, f"request {i}"
        assert out.finish_reason == "length"
        for pos, (tok, logits) in enumerate(zip(out.token_ids, ref_logits)):
            ref_lp = torch.log_softmax(logits, -1)[tok].item()
            assert out.logprobs[pos][tok].logprob == pytest.approx(ref_lp, abs=2e-4)


@pytest.mark.parametrize("how", ["fqcn", "class", "entry_point"])
def test_seed_dummy_processor_end_to_end(tiny_model, how, monkeypatch):
    if how == "entry_point":
        monkeypatch.syspath_prepend(str(PLUGIN_SITE))
        llm = make_llm(tiny_model, load_entry_points=True)
    else:
        llm = make_llm(tiny_model, logits_processors=[DUMMY_FQCN if how == "fqcn" else DummyLogitsProcessor])
    names = [type(p).__name__ for p in llm.engine.processors.all]
    assert "DummyLogitsProcessor" in names
    prompts = prompts_of(tiny_model, 4, seed=2)
    target = 67
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args={"target_token": target}),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True, extra_args={"target_token": 5}),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids == [target] * 8
    assert outs[2].outputs[0].token_ids == [5] * 8
    baseline = make_llm(tiny_model).generate(
        [prompts[1], prompts[3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert outs[1].outputs[0].token_ids == baseline[0].outputs[0].token_ids
    assert outs[3].outputs[0].token_ids == baseline[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="target_token"):
        llm.generate(prompts[0], SamplingParams(extra_args={"target_token": "abc"}))


def test_adapter_wrapped_request_level_processor(tiny_model):
    llm = make_llm(tiny_model, logits_processors=[WrappedPerReqLogitsProcessor])
    prompts = prompts_of(tiny_model, 2, seed=3)
    outs = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"target_token": 42}),
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        ],
    )
    assert outs[0].outputs[0].token_ids == [42] * 6
    ref, _ = hf_greedy(tiny_model, prompts[1], 6)
    assert outs[1].outputs[0].token_ids == ref


def test_seeded_sampling_is_batch_invariant(tiny_model):
    llm = make_llm(tiny_model, max_num_seqs=32)
    prompt = prompts_of(tiny_model, 1, seed=4)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = prompts_of(tiny_model, 30, seed=5)
    crowd = llm.generate(
        [*others[:13], prompt, *others[13:]],
        [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 13
        + [params]
        + [SamplingParams(temperature=0.7, top_k=20, max_tokens=12, ignore_eos=True)] * 17,
    )
    assert crowd[13].outputs[0].token_ids == alone
    other_seed = llm.generate(
        [prompt], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_min_tokens(tiny_model):
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=6)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok]))[0].outputs[
        0
    ]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until min_tokens outputs exist
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first + 2, stop_token_ids=[stop_tok])
    )[0].outputs[0]
    assert stop_tok not in out.token_ids[: first + 2]
    assert len(out.token_ids) >= first + 2


def test_stop_strings_are_cut_from_text(tiny_model):
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=7)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    idx = text.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:idx]
    assert stop not in out.text


def test_eos_stops_unless_ignored(tiny_model):
    eos = min(tiny_model.eos_token_ids)
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=8)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0}))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={eos: 100.0})
    )[0].outputs[0]
    assert out.token_ids == [eos] * 10 and out.finish_reason == "length"


def test_bad_words_and_allowed_token_ids(tiny_model):
    llm = make_llm(tiny_model)
    tok = tiny_model.tokenizer
    prompt = prompts_of(tiny_model, 1, seed=9)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    word = tok.decode([free.token_ids[0]]).strip()
    assert word
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=[word]))[
        0
    ].outputs[0]
    banned = {
        ids[-1] for form in (word, " " + word) for ids in [tok.encode(form, add_special_tokens=False)] if len(ids) == 1
    }
    assert banned and not banned & set(out.token_ids)
    allowed = [11, 12, 13]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)
    )[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_no_finite_logit_fails_only_that_request(tiny_model):
    llm = make_llm(tiny_model)
    tok = tiny_model.tokenizer
    word_ids = [
        i
        for i in range(50, 200)
        if len(tok.encode(tok.decode([i]).strip(), add_special_tokens=False)) == 1 and tok.decode([i]).strip()
    ][:2]
    words = [tok.decode([i]).strip() for i in word_ids]
    only = [tok.encode(w, add_special_tokens=False)[0] for w in words]
    prompts = prompts_of(tiny_model, 2, seed=10)
    outs = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0.0, max_tokens=5, allowed_token_ids=only, bad_words=words),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        ],
    )
    assert outs[0].outputs[0].finish_reason == "error"
    assert "every token was excluded" in outs[0].outputs[0].error
    assert outs[0].outputs[0].token_ids == []
    assert len(outs[1].outputs[0].token_ids) == 5 and outs[1].outputs[0].finish_reason == "length"


def reference_penalized_greedy(loaded, prompt, n, rep, freq, pres):
    """Plain per-step reference: full forward, docs/sampling.md "The nine steps" step 6 penalties, argmax."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.tensor([prompt + out], device=loaded.device)
            logits = loaded.model(ids).logits[0, -1].float().clone()
            for tok in set(prompt) | set(out):
                x = logits[tok]
                logits[tok] = x / rep if x > 0 else x * rep
            for tok in set(out):
                logits[tok] -= freq * out.count(tok) + pres
            out.append(int(torch.argmax(logits)))
    return out


@pytest.mark.parametrize("rep,freq,pres", [(1.0, 1.5, 0.5), (1.8, 0.0, 0.0), (1.3, -0.5, 1.0)])
def test_penalties_match_a_plain_reference(tiny_model, rep, freq, pres):
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=11)[0]
    got = (
        llm.generate(
            [prompt],
            SamplingParams(
                temperature=0.0,
                max_tokens=12,
                ignore_eos=True,
                repetition_penalty=rep,
                frequency_penalty=freq,
                presence_penalty=pres,
            ),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert got == reference_penalized_greedy(tiny_model, prompt, 12, rep, freq, pres)


def test_huge_repetition_penalty_avoids_every_seen_token(tiny_model):
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=12)[0]
    ids = (
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=1e4))[
            0
        ]
        .outputs[0]
        .token_ids
    )
    assert len(set(ids)) == len(ids) and not set(ids) & set(prompt)


def test_logprobs_ranks_and_cumulative(tiny_model):
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=12)[0]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, logprobs=3))[
        0
    ].outputs[0]
    assert len(out.logprobs) == 10
    total = 0.0
    for tok, position in zip(out.token_ids, out.logprobs):
        assert len(position) in (3, 4)
        assert tok in position
        ranks = sorted(lp.rank for lp in position.values())
        if len(position) == 3:  # the sampled token is one of the top 3
            assert ranks == [1, 2, 3]
        else:
            assert position[tok].rank > 3 and ranks[:3] == [1, 2, 3]
        by_rank = sorted(position.values(), key=lambda lp: lp.rank)
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(by_rank))
        total += position[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_n_greater_than_one(tiny_model):
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=13)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert all(len(s) == 8 for s in seqs)
    assert len(set(seqs)) > 1
    again = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs


def test_generate_validates_everything_before_admitting(tiny_model):
    llm = make_llm(tiny_model, logits_processors=[DUMMY_FQCN])
    prompts = prompts_of(tiny_model, 3, seed=14)
    with pytest.raises(ValueError, match=r"request 2: .*target_token"):
        llm.generate(prompts, [SamplingParams(), SamplingParams(), SamplingParams(extra_args={"target_token": 1.5})])
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompts[0], SamplingParams(logit_bias={tiny_model.vocab_size: 1.0}))
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(prompts[0], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams())


def test_raising_processor_is_isolated(tiny_model):
    llm = make_llm(tiny_model, logits_processors=["tests.fixtures.seed_processors:RaisingLogitsProcessor"])
    prompts = prompts_of(tiny_model, 3, seed=15)
    for phase in ("apply", "update_state"):
        outs = llm.generate(
            prompts,
            [
                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"raise_in": phase}),
                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
            ],
        )
        c = outs[1].outputs[0]
        assert c.finish_reason == "error"
        assert "RaisingLogitsProcessor" in c.error and phase in c.error
        for i in (0, 2):  # the fault stays with its request
            assert outs[i].outputs[0].finish_reason == "length"
            assert outs[i].outputs[0].token_ids == hf_greedy(tiny_model, prompts[i], 6)[0]
        ok = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        ref, _ = hf_greedy(tiny_model, prompts[0], 6)
        assert ok[0].outputs[0].token_ids == ref
        assert all(o.outputs[0].finish_reason == "length" for o in ok)


def test_abort_frees_row_within_one_step(tiny_model):
    engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
    prompts = prompts_of(tiny_model, 2, seed=16)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert sorted(engine.batch_request_ids()) == ["a0", "a1"]
    engine.abort_request("a0")
    outs = engine.step()
    assert engine.batch_request_ids() == ["a1"]
    aborted = [o for o in outs if o.request_id == "a0"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert engine.kv_stats()["blocks_used"] == len(engine.scheduler.running[0].block_ids)  # a0's blocks freed


def test_context_length_finishes_with_length(tiny_model):
    llm = make_llm(tiny_model, max_model_len=40)
    prompt = prompts_of(tiny_model, 1, lo=30, hi=31, seed=17)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 40


def test_text_matches_full_decode(tiny_model):
    llm = make_llm(tiny_model)
    tok = tiny_model.tokenizer
    for prompt in prompts_of(tiny_model, 3, seed=18):
        out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))[
            0
        ].outputs[0]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_a_request_id_can_be_reused_as_soon_as_it_finished(tiny_model):
    """The finished sequence still sits in the batch until the next update; the new one must not clash."""
    engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=19)[0]
    for _ in range(3):
        engine.add_request("same", prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        finished = False
        while not finished:
            finished = any(o.finished for o in engine.step())
    assert not engine.has_unfinished() or engine.step() == []


def test_a_duplicate_running_request_id_is_answered_with_an_error(tiny_model):
    engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=20)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("dup", prompt, params)
    engine.step()
    engine.add_request("dup", prompt, params)
    outs = engine.step()
    rejected = [o for o in outs if o.finished and o.outputs[0].finish_reason == "error"]
    assert len(rejected) == 1 and "duplicate request id" in rejected[0].outputs[0].error
    finished = None
    while engine.has_unfinished():
        finished = next((o for o in engine.step() if o.finished), finished)
    assert finished is not None and finished.outputs[0].finish_reason == "length"


def test_queue_time_is_reported_on_a_sequences_last_output(tiny_model):
    """The engine's queue time (arrival to first step in the batch, vLLM's) rides on a sequence's
    last output only; with one row, the second request waits for the first to finish."""
    engine = LLMEngine(engine_config(max_num_seqs=1, load_entry_points=False), loaded=tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts_of(tiny_model, 2, seed=21)):
        engine.add_request(f"q{i}", prompt, params)
    queue: dict[str, float] = {}
    for _ in range(100):
        for out in engine.step():
            (c,) = out.outputs
            assert (c.queue_time_s is not None) == c.finished
            if c.queue_time_s is not None:
                queue[out.request_id] = c.queue_time_s
        if not engine.has_unfinished():
            break
    assert set(queue) == {"q0", "q1"} and queue["q0"] >= 0.0
    # q1 was admitted only after q0's last step: it waited through q0's whole run.
    assert queue["q1"] > queue["q0"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_stop_token_stays_in_the_token_ids_but_not_the_text(tiny_model, skip_special_tokens):
    """As vLLM: the token that stops a sequence (EOS, or one of stop_token_ids) is not rendered,
    so `<|eos|>` never ends an answer, even with special tokens kept."""
    llm = make_llm(tiny_model)
    tok = tiny_model.tokenizer
    eos = tok.eos_token_id
    prompt = prompts_of(tiny_model, 1, seed=21)[0]
    plain = tok.convert_tokens_to_ids(tok.tokenize(" the"))[-1]
    for stop_tok, kw in ((eos, {}), (plain, {"stop_token_ids": [plain]})):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=6,
            min_tokens=2,
            logit_bias={stop_tok: 100.0},
            skip_special_tokens=skip_special_tokens,
            **kw,
        )
        (c,) = llm.generate([prompt], params)[0].outputs
        assert c.finish_reason == "stop" and c.token_ids[-1] == stop_tok and len(c.token_ids) == 3, c
        expected = tok.decode(c.token_ids[:-1], skip_special_tokens=skip_special_tokens)
        assert c.text == expected and not c.text.endswith(tok.decode([stop_tok]))
