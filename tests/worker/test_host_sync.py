"""Host reads per step (docs/sampling.md "Host reads"): ``ops.host_sync.to_host`` is the one place
a step's device results reach the host, a steady-state step reads exactly once (sampler level and
engine level), the rare paths stay within their documented bound and give the reference's tokens,
and no raw read is left on the step path outside that module."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.worker import sampler_reference as ref
from tests.worker.model_fixtures import engine_config
from worker.batch import PersistentBatch
from worker.engine import LLMEngine
from worker.logits_processor.registry import LogitsProcessors, build_logits_processors
from worker.ops.host_sync import HostRead, as_lists, host_lists, record_host_reads, to_host
from worker.sampler import Sampler, SamplerOutput
from worker.sampling_metadata import SamplingMetadata
from worker.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
V = 3000

# -- to_host ----------------------------------------------------------------------------------

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float64, torch.bfloat16]


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), min_size=0, max_size=3)), min_size=1, max_size=6
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_to_host_brings_every_tensor_back_in_one_read(specs: list[tuple[torch.dtype, list[int]]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(shape, generator=g) * 50).to(dtype) for dtype, shape in specs]
    with record_host_reads() as log:
        got = to_host(*tensors, label="t")
    assert log == [HostRead("t", len(tensors), sum(t.numel() * t.element_size() for t in tensors))]
    for a, b in zip(tensors, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if a.numel():
            a.view(-1)[0] = 1 - a.view(-1)[0].to(torch.int64)  # writing the input leaves the copy alone
            assert not torch.equal(a, b)


def test_to_host_of_strided_and_scalar_tensors() -> None:
    x = torch.arange(24).view(4, 6)
    col, scalar = x[:, 1], torch.tensor(2.5)
    a, b = to_host(col, scalar)
    assert a.tolist() == [1, 7, 13, 19] and b.item() == 2.5 and b.shape == ()


def test_host_lists_and_as_lists() -> None:
    with record_host_reads() as log:
        ints, flags = host_lists(torch.tensor([3, 4]), torch.tensor([True, False]))
        assert as_lists(torch.tensor([1.5])) == ([1.5],)
    assert (ints, flags) == ([3, 4], [True, False]) and len(log) == 1
    with pytest.raises(ValueError, match="to_host first"):
        as_lists(torch.empty(2, device="meta"))


# -- the sampler: one read in the steady state ----------------------------------------------------

STEADY = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k": dict(temperature=0.8, top_k=20),
    "top-p": dict(temperature=0.8, top_p=0.9),
    "top-k-top-p": dict(temperature=0.8, top_k=40, top_p=0.9),
}


def _batch(params: Sequence[SamplingParams]) -> tuple[LogitsProcessors, SamplingMetadata]:
    procs = build_logits_processors(None, torch.device("cpu"), False, entry_points=False)
    pb = PersistentBatch(len(params))
    procs.update_state(pb.update([], [(str(i), p, [1, 2], [3]) for i, p in enumerate(params)]))
    return procs, pb.sampling_metadata()


def _sample(params: Sequence[SamplingParams], x: torch.Tensor, seed: int = 0) -> tuple[SamplerOutput, list[str]]:
    procs, md = _batch(params)
    sampler = Sampler(procs, generator=torch.Generator().manual_seed(seed))
    with record_host_reads() as log:
        out = sampler(x.clone(), md)
    return out, [r.label for r in log]


def _peaked(b: int, seed: int = 0) -> torch.Tensor:
    """Rows like a trained model's (randn * 8): every top-p nucleus fits the probe."""
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 8


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("logprobs", [None, 0, 5], ids=["no-logprobs", "logprobs-0", "logprobs-5"])
@pytest.mark.parametrize("mode", list(STEADY))
def test_steady_state_call_reads_the_host_once(mode: str, logprobs: int | None, seeded: bool) -> None:
    params = [
        SamplingParams(**STEADY[mode], logprobs=logprobs, seed=100 + i if seeded else None, max_tokens=8)
        for i in range(6)
    ]
    out, labels = _sample(params, _peaked(6))
    assert labels == ["sampler"]
    assert not out.errors.any() and out.sampled_token_ids.device.type == "cpu"
    assert (out.logprobs is None) == (logprobs is None)


def test_mixed_batch_with_a_forced_row_reads_once() -> None:
    """+inf rows are rewritten on the device unconditionally: a forced row costs no read."""
    params = [SamplingParams(**STEADY[m], logprobs=2) for m in STEADY]
    x = _peaked(len(params))
    x[1, [7, 2900]] = float("inf")
    x[0, 11] = float("inf")
    out, labels = _sample(params, x)
    assert labels == ["sampler"]
    assert out.sampled_token_ids[0].item() == 11 and out.sampled_token_ids[1].item() in (7, 2900)
    assert not out.errors.any()


# -- the rare paths: their bound, and the reference's results --------------------------------------


def test_top_p_nucleus_missing_the_probe_reads_three_times() -> None:
    """Flat rows: the nucleus is thousands of tokens, the histogram cuts it (its own read), then
    the exact pass's read."""
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0)]
    x = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    _, labels = _sample(params, x)
    assert labels == ["sampler", "top-p histogram", "sampler exact pass"]


def test_processed_mode_reads_twice() -> None:
    params = [SamplingParams(temperature=0.8, top_k=30, logprobs=3, logprobs_mode="processed_logprobs")]
    out, labels = _sample(params, _peaked(1))
    assert labels == ["sampler", "sampler exact pass"]
    assert out.logprobs is not None and (out.logprobs.token_ids[0, 1:] >= 0).all()


def test_top_k_draw_landing_on_a_tie_takes_the_lowest_ids() -> None:
    """Every logit equal: the top-3 are ids 0-2 exactly, which the first pass cannot know."""
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(8)]
    out, labels = _sample(params, torch.zeros(8, V))
    assert labels == ["sampler", "sampler exact pass"]
    assert set(out.sampled_token_ids.tolist()) <= {0, 1, 2}


def test_raw_logprob_top_k_tie_takes_the_lowest_ids() -> None:
    x = torch.zeros(2, V)
    x[:, 500] = 1.0
    out, labels = _sample([SamplingParams(temperature=0.0, logprobs=3)] * 2, x)
    assert labels == ["sampler", "sampler exact pass"]
    assert out.logprobs is not None and out.logprobs.token_ids.tolist() == [[500, 500, 0, 1]] * 2


@st.composite
def tied_rows(draw: st.DrawFn, n: int, v: int) -> torch.Tensor:
    """Rows of few distinct values (many exact ties at any k-th place), some -inf."""
    levels = draw(st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, float("-inf")]), min_size=2, max_size=4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.tensor(levels, dtype=torch.float32)[torch.randint(len(levels), (n, v), generator=g)]
    x[:, 0] = 2.0  # a finite logit in every row
    return x


def _near_a_boundary(x: torch.Tensor, p: SamplingParams) -> bool:
    """The row's top-p cut is within float noise of a prefix mass (the reference sums differently)."""
    top_p = float(torch.tensor(p.top_p, dtype=torch.float32))
    if top_p >= 1.0:
        return False
    return ref.top_p_margin(ref.top_k(x / torch.tensor(p.temperature), p.top_k), top_p) < 1e-5


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_folded_path_matches_the_reference_on_tied_rows(data: st.DataObject, n: int, seed: int) -> None:
    """Tie-heavy rows through top-k (with and without top-p), full-row top-p and raw logprobs:
    the tokens are the reference's inverse-CDF draws with the same uniforms, the logprobs the
    reference's top-K (value desc, id asc) and rank; the reads stay within the documented bound."""
    v = data.draw(st.sampled_from([40, 700, 5000, 12000]))  # the larger ones take top-k through block maxima
    x = data.draw(tied_rows(n, v))
    params = []
    asks = data.draw(st.booleans())  # without logprobs, only a draw landing on a tie runs the exact pass
    for i in range(n):
        t = data.draw(st.sampled_from([0.0, 0.7, 1.0]))
        lp = data.draw(st.sampled_from([None, 2, 4] if asks else [None]))
        if t == 0.0:
            params.append(SamplingParams(temperature=0.0, logprobs=lp))
            continue
        k, top_p = data.draw(st.sampled_from([0, 1, 3, 10])), data.draw(st.sampled_from([1.0, 0.6]))
        params.append(SamplingParams(temperature=t, top_k=k, top_p=top_p, logprobs=lp, seed=seed + i))
    out, labels = _sample(params, x)
    event(f"reads: {labels}")
    assert labels[0] == "sampler" and labels[-1] in ("sampler", "sampler exact pass") and len(labels) <= 3
    for r, p in enumerate(params):
        got = out.sampled_token_ids[r].item()
        if p.is_greedy:
            assert got == ref.greedy_token(x[r])
        else:
            u = float(torch.rand(1, dtype=torch.float64, generator=_seeded(p.seed)))
            want, margin = ref.inverse_cdf(*ref.draw_sequence(x[r], p, [1, 2], [3]), u)
            if margin > 1e-6 and not _near_a_boundary(x[r], p):
                event("random row checked")
                assert got == want, (r, p)
        if p.logprobs is not None:
            assert out.logprobs is not None
            raw = torch.log_softmax(x[r], -1)
            top = ref.order(raw)[: p.logprobs]
            assert out.logprobs.token_ids[r, : p.logprobs + 1].tolist() == [got, *top]
            assert out.logprobs.ranks[r].item() == int((raw >= raw[got]).sum())


def _seeded(seed: int | None) -> torch.Generator:
    from worker.batch import seeded_generator

    assert seed is not None
    return seeded_generator(seed, torch.device("cpu"))


# -- the engine: one read per decode step ---------------------------------------------------------

ENGINE_MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k": dict(temperature=0.8, top_k=20),
    "top-p": dict(temperature=0.5, top_p=0.5),  # the tiny model's nucleus fits the probe here
}


@pytest.mark.parametrize("logprobs", [None, 3], ids=["no-logprobs", "logprobs"])
@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_engine_step_reads_the_host_once(tiny_model, mode: str, logprobs: int | None) -> None:
    """Every step of a run (prefill + sample, decode, requests finishing) makes exactly one read."""
    engine = LLMEngine(engine_config(max_num_seqs=8, load_entry_points=False), loaded=tiny_model)
    for i in range(4):
        params = SamplingParams(
            **ENGINE_MODES[mode], logprobs=logprobs, seed=i if i % 2 else None, max_tokens=6 + i, ignore_eos=True
        )
        engine.add_request(f"r{i}", list(range(10, 20 + 3 * i)), params)
    per_step, tokens = [], 0
    while engine.has_unfinished():
        with record_host_reads() as log:
            outs = engine.step()
        per_step.append([r.label for r in log])
        tokens += len(outs)
    assert per_step == [["sampler"]] * len(per_step) and len(per_step) == 9 and tokens > 0


def test_engine_prompt_logprobs_chunk_reads_once_more(tiny_model) -> None:
    engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
    engine.add_request("p", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
    per_step = []
    while engine.has_unfinished():
        with record_host_reads() as log:
            engine.step()
        per_step.append([r.label for r in log])
    assert per_step[0] == ["sampler", "prompt logprobs"] and per_step[1:] == [["sampler"]] * 2


# -- CUDA: no other sync in a steady-state call ----------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", list(STEADY))
def test_cuda_steady_state_call_has_no_other_sync(mode: str) -> None:
    dev = torch.device("cuda")
    params = [SamplingParams(**STEADY[mode], logprobs=2, seed=i if i % 2 else None) for i in range(6)]
    procs = build_logits_processors(None, dev, True, entry_points=False)
    pb = PersistentBatch(len(params), device=dev, pin_memory=True)
    procs.update_state(pb.update([], [(str(i), p, [1, 2], [3]) for i, p in enumerate(params)]))
    md = pb.sampling_metadata()
    sampler = Sampler(procs, generator=torch.Generator(device=dev).manual_seed(0))
    x = _peaked(len(params)).to(dev)
    first = sampler(x.clone(), md)  # builds the plan (per batch change, not per step)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with record_host_reads() as log:
            again = Sampler(procs, generator=torch.Generator(device=dev).manual_seed(0))
            again._plan, again._plan_key = sampler._plan, sampler._plan_key
            out = again(x.clone(), md)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert [r.label for r in log] == ["sampler"]
    assert torch.equal(out.sampled_token_ids, first.sampled_token_ids)


# -- the guard: no raw read on the step path outside host_sync -------------------------------------

STEP_PATH = [
    "worker/sampler.py",
    "worker/sampling_metadata.py",
    "worker/batch.py",
    "worker/executor/executor.py",
    "worker/executor/output.py",
    "worker/engine.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "worker/ops").glob("*.py") if p.name != "host_sync.py"),
]
RAW_READ = re.compile(r"\.(item|tolist|cpu|numpy)\(\)")
# Reads of tensors that live on the host by construction: (file, code) -> why.
HOST_ONLY = {
    ("worker/ops/cutoff.py", "for r, t in zip(rows.rows, under.flatten().tolist()):"): "the CPU-device branch only",
    ("worker/batch.py", "tuple(greedy.tolist()),"): "the batch's CPU columns",
    ("worker/batch.py", 'tuple(cpu["top_k"].tolist()),'): "the batch's CPU columns",
    ("worker/batch.py", 'tuple(cpu["top_p"].tolist()),'): "the batch's CPU columns",
    ("worker/batch.py", 'tuple(cpu["num_logprobs"].tolist()),'): "the batch's CPU columns",
}


def test_no_raw_device_read_on_the_step_path() -> None:
    found = []
    for path in STEP_PATH:
        for line in (ROOT / path).read_text().splitlines():
            code = line.split("#")[0].strip()
            if RAW_READ.search(code) and not code.startswith(('"""', "``")) and (path, code) not in HOST_ONLY:
                found.append(f"{path}: {code}")
    assert not found, "raw device reads outside worker/ops/host_sync.py:\n" + "\n".join(found)


# -- the guard: no blocking host-to-device copy on the step path ------------------------------------

COPY_PATH = [
    *STEP_PATH,
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "worker/model").glob("*.py")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "worker/logits_processor").rglob("*.py")),
]
# ``torch.tensor(values, device=...)`` where it is not on a step's way: (file, call) -> why.
OFF_THE_STEP = {
    ("worker/ops/cutoff.py", "torch.tensor(_NEG_INF, dtype=threshold.dtype, device=threshold.device)"): "CPU only",
    ("worker/sampler.py", "torch.tensor(bad, device=call.x.device)"): "the error path (a row already failed)",
    ("worker/sampler.py", "torch.tensor(rows, device=y.device)"): "the error path (naming a NaN's source)",
}


def test_no_blocking_host_to_device_copy_on_the_step_path() -> None:
    """``torch.tensor(values, device=cuda)`` copies from pageable memory, and torch then syncs the
    stream: the host waits for every kernel queued before it (the sampler's cutoff did this on
    every top-k/top-p step, the flex plan on every prompt step). Small host-built tensors go
    through ``worker.ops.staging.to_device`` (pinned, non-blocking); a device constant is a fill
    (``x.new_full``). Checked on the source (CPU has no such sync to count); on CUDA
    ``test_cuda_steady_state_call_has_no_other_sync`` runs a step under sync debug mode."""
    import ast

    found = []
    for path in COPY_PATH:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            func = node.func
            is_tensor = func.attr in ("tensor", "as_tensor") and isinstance(func.value, ast.Name)
            if is_tensor and func.value.id == "torch" and any(k.arg == "device" for k in node.keywords):  # type: ignore[attr-defined]
                call = ast.unparse(node)
                if (path, call) not in OFF_THE_STEP:
                    found.append(f"{path}:{node.lineno}: {call}")
    assert not found, "blocking host-to-device copies on the step path:\n" + "\n".join(found)
