"""The padded static decode path (``cuda_graphs``) against the dynamic path it replaces.

Reference: the same runner code with ``cuda_graphs=False`` (the dynamic path, itself tested
against ``generate()`` in test_runner). On CPU the padded path runs eagerly, the very code a CUDA
graph captures: its logits must equal the dynamic path's for random batches, block tables and
context lengths over several families (GQA, sliding windows, softcap); an engine must give the
same greedy and seeded tokens with it as without, through joins, departures and mixed steps; its
padding rows must write only the reserved null block, which no request is ever given. The CUDA
test (skipped without a GPU) captures and replays and compares with eager.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.model_fixtures import engine_config
from tests.worker.test_model_matrix import _build
from tests.worker.test_paged_engine import _run
from tests.worker.test_runner import ATOL
from worker.engine import LLMEngine
from worker.model.loader import LoadedModel
from worker.model.runner import ModelRunner, ScheduledSeq, block_bytes
from worker.model.static_decode import batch_buckets, resolve_mode, width_buckets
from worker.sampling_params import SamplingParams

# GQA in every family (4 query heads on 2 KV heads, the tiny model 8 on 4); mistral_window and
# gemma3 slide a 12-token window; gemma2 slides it and softcaps attention and final logits.
FAMILIES = ("tiny", "llama", "qwen2", "mistral_window", "gemma2", "gemma3")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model: LoadedModel) -> dict[str, LoadedModel]:
    built = {f: _build(f, tmp_path_factory.mktemp(f), tiny_model.tokenizer) for f in FAMILIES if f != "tiny"}
    return {"tiny": tiny_model, **built}


def _recording(runner: ModelRunner, steps: list[list[ScheduledSeq]]) -> None:
    """Record every step the runner executes (the executor calls ``runner.execute``)."""
    execute = runner.execute

    def record(seqs, feed=None):
        steps.append(list(seqs))
        return execute(seqs, feed)

    runner.execute = record  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- logits == dynamic


@settings(max_examples=30, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    contexts=st.lists(st.integers(0, 60), min_size=1, max_size=10),
    block_size=st.sampled_from([4, 16]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_padded_decode_logits_equal_the_dynamic_path(
    models: dict[str, LoadedModel], family: str, contexts: list[int], block_size: int, steps: int, seed: int
) -> None:
    loaded = models[family]
    rng = random.Random(seed)
    max_len = 72
    per_seq = -(-max_len // block_size)
    num_blocks = per_seq * len(contexts) + 1  # + the static runner's null block
    dynamic = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size, max_model_len=max_len)
    static = ModelRunner(
        loaded, num_blocks=num_blocks, block_size=block_size, max_model_len=max_len, cuda_graphs=True, max_num_seqs=10
    )
    assert static.static is not None and static.num_blocks == num_blocks - 1
    ids = rng.sample(range(static.num_blocks), static.num_blocks)  # tables scattered over the pool
    tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(len(contexts))]
    vocab = loaded.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in contexts]
    for runner in (dynamic, static):  # prompts through the dynamic path of each
        for table, prompt in zip(tables, prompts):
            if prompt:
                runner.execute([ScheduledSeq(table, prompt, 0, False)])
    positions = list(contexts)
    live = list(range(len(contexts)))
    for step in range(steps):
        rng.shuffle(live)  # the rows move between steps: the persistent table swaps/rewrites
        if len(live) > 1 and rng.random() < 0.3:
            live.pop()  # a row leaves
        seqs = [ScheduledSeq(tables[i], [rng.randrange(vocab)], positions[i], True) for i in live]
        want = dynamic.execute(seqs)
        got = static.execute(seqs)
        assert static.static.num_steps == step + 1, "every step here is pure decode: the padded path"
        assert got.shape == want.shape == (len(seqs), vocab)
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        for i in live:
            positions[i] += 1


def test_padding_rows_write_only_the_null_block(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model, num_blocks=9, block_size=4, max_model_len=32, cuda_graphs=True, max_num_seqs=8)
    assert runner.static is not None and runner.static.null_block == 8
    tables = [[0, 1], [2, 3], [4, 5]]
    for table in tables:
        runner.execute([ScheduledSeq(table, list(range(10, 15)), 0, False)])
    for k in runner._k:
        k[:, 8] = 5.0  # a marker in the null block (token 0's key may be all zeros)
    k_before = [k.clone() for k in runner._k]
    runner.execute([ScheduledSeq(t, [7], 5, True) for t in tables])  # 3 rows: padded to the bucket of 4
    assert runner.static.bucket_steps == {(4, 4): 1}
    written = {(b, 1) for b in (1, 3, 5)}  # each row's position 5: block 1 of its table, offset 1
    for before, after in zip(k_before, runner._k):
        changed = {(b, o) for b in range(9) for o in range(4) if not torch.equal(before[:, b, o], after[:, b, o])}
        assert changed - {(8, o) for o in range(4)} == written
        assert (8, 0) in changed  # the padding row wrote its key into the null block


def test_each_bucket_copies_one_contiguous_prefix_of_the_inputs(tiny_model: LoadedModel) -> None:
    """A step's inputs go to the device in one copy of a contiguous prefix (a strided [4, rows]
    slice of a [4, max] buffer made CUDA sync the stream before the copy), and each bucket reads a
    fixed address (what its graph captured)."""
    runner = ModelRunner(tiny_model, num_blocks=9, block_size=4, max_model_len=32, cuda_graphs=True, max_num_seqs=8)
    static = runner.static
    assert static is not None
    for rows in static.buckets:
        view = static._rows_inputs(rows)
        assert view.shape == (4, rows) and view.is_contiguous() and view.data_ptr() == static._inputs.data_ptr()
    tables = [[0, 1], [2, 3], [4, 5]]
    for table in tables:
        runner.execute([ScheduledSeq(table, list(range(10, 15)), 0, False)])
    runner.execute([ScheduledSeq(t, [7 + i], 5, True) for i, t in enumerate(tables)])  # bucket of 4
    null_slot = static.null_block * 4
    assert static._rows_inputs(4).tolist() == [[7, 8, 9, 0], [5, 5, 5, 0], [5, 13, 21, null_slot], [6, 6, 6, 1]]


# ----------------------------------------------------------------------------- the engine


def _requests(n: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded-sampled and unseeded-sampled requests of mixed lengths (rows leave at different steps)."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        prompt = torch.randint(10, 2900, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        kind = i % 3
        params = SamplingParams(
            temperature=0.0 if kind == 0 else 0.9,
            top_p=1.0 if kind == 0 else 0.95,
            seed=100 + i if kind == 1 else None,
            max_tokens=int(torch.randint(4, 24, (1,), generator=g)),
            ignore_eos=True,
        )
        reqs.append((prompt, params))
    return reqs


def _engine(loaded: LoadedModel, **kw: Any) -> LLMEngine:
    fields: dict[str, Any] = dict(
        load_entry_points=False, max_num_seqs=12, max_num_batched_tokens=40, block_size=4, max_model_len=96, seed=5
    )
    return LLMEngine(engine_config(**{**fields, **kw}), loaded=loaded)


def _tokens(done: dict) -> dict[str, list[int]]:
    return {rid: list(out.outputs[0].token_ids) for rid, out in sorted(done.items())}


def test_engine_tokens_equal_with_the_padded_path(tiny_model: LoadedModel) -> None:
    reqs = _requests(16)
    want = _run(_engine(tiny_model, cuda_graphs=False), reqs, stagger=2)
    engine = _engine(tiny_model, cuda_graphs=True)
    steps: list[list[ScheduledSeq]] = []
    _recording(engine.runner, steps)
    got = _run(engine, reqs, stagger=2)
    assert _tokens(got) == _tokens(want)
    static = engine.runner.static
    assert static is not None
    # What the run went through: several batch buckets (and widths), and mixed steps in between.
    assert len({rows for rows, _ in static.bucket_steps}) >= 4, static.bucket_steps
    assert len({width for _, width in static.bucket_steps}) >= 2, static.bucket_steps
    decode = [s for s in steps if all(len(q.token_ids) == 1 for q in s)]
    mixed = [s for s in steps if {len(q.token_ids) == 1 for q in s} == {True, False}]
    assert static.num_steps == len(decode) and mixed
    assert static.table.num_appended > 0, "rows crossing into a new block were appended, not rewritten"


def test_the_null_block_is_never_given_to_a_request(tiny_model: LoadedModel) -> None:
    bs, blocks = 4, 12
    kv = blocks * block_bytes(tiny_model, bs)
    plain = _engine(tiny_model, kv_cache_bytes=kv, block_size=bs)
    engine = _engine(tiny_model, kv_cache_bytes=kv, block_size=bs, cuda_graphs=True)
    runner = engine.runner
    assert runner.pool_blocks == plain.runner.pool_blocks == blocks
    assert runner.kv_cache_bytes == plain.runner.kv_cache_bytes  # the null block comes out of the budget
    assert engine.kv.num_blocks == runner.num_blocks == blocks - 1 and plain.kv.num_blocks == blocks
    assert engine.kv.capacity_tokens == (blocks - 1) * bs == engine.kv_stats()["blocks_total"] * bs
    null = runner.static.null_block if runner.static else None
    assert null == blocks - 1
    # A request needing the whole pool fits without the padded path, not with it (one block less).
    whole = SamplingParams(max_tokens=blocks * bs - 4, ignore_eos=True)
    plain.add_request("whole", [5, 6, 7, 8], whole)
    with pytest.raises(ValueError, match="more than the whole pool"):
        engine.add_request("whole", [5, 6, 7, 8], whole)
    # A tight pool: requests are preempted and their blocks handed out again, never the null block.
    steps: list[list[ScheduledSeq]] = []
    _recording(runner, steps)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p, _ in _requests(6)]
    _run(engine, reqs, stagger=1)
    seen = {b for step in steps for s in step for b in s.block_ids}
    assert null not in seen and seen == set(range(blocks - 1)), "every usable block, and only those, was handed out"
    assert engine.kv_stats()["num_preemptions"] > 0 and runner.static is not None and runner.static.num_steps > 0
    stats = engine.kv_stats()
    assert stats["blocks_free"] == blocks - 1 and stats["blocks_used"] == 0  # all back after the run


def test_tensor_parallel_ranks_take_the_padded_path_too(models: dict[str, LoadedModel], tmp_path) -> None:
    """TP = 2 on CPU (gloo) with the padded path gives TP = 1's dynamic tokens: rank 1 pads the same
    steps to the same buckets, or the logits gather inside the forward would not line up."""
    from tests.worker.test_paged_engine import _engine as paged_engine
    from tests.worker.test_tensor_parallel import BLOCK_SIZE, BLOCKS, _tp2, _workload

    loaded = _build("llama", tmp_path, models["tiny"].tokenizer)
    reqs = _workload(seeded=True)
    one = paged_engine(loaded, blocks=BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=24)
    want = _run(one, reqs, stagger=1)
    two = _tp2(str(tmp_path), loaded, cuda_graphs=True)
    try:
        got = _run(two, reqs, stagger=1)
        static = two.runner.static
    finally:
        two.close()
    assert static is not None and static.num_steps > 0 and len(static.bucket_steps) > 1
    assert _tokens(got) == _tokens(want)


# ----------------------------------------------------------------------------- choices and refusals


def test_buckets_modes_and_refusals(tiny_model: LoadedModel) -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(4096)[-3:] == (496, 504, 512)  # clamped to the largest capture size, not refused
    assert width_buckets(256, 4) == (4, 16, 64, 256)
    assert width_buckets(40, 2) == (4, 5, 10, 20, 40)
    assert width_buckets(3, 2) == (3,)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode(None, cpu, sharded=False) == "off"
    assert resolve_mode(None, cuda, sharded=False) == "graphs"
    assert resolve_mode(None, cuda, sharded=True) == "off"  # opt in on a tensor-parallel group
    assert resolve_mode(True, cuda, sharded=True) == "graphs"
    assert resolve_mode(True, cpu, sharded=False) == "eager"
    assert resolve_mode(False, cuda, sharded=False) == "off"
    with pytest.raises(ValueError, match=r"cuda_graphs: .* not mps"):
        resolve_mode(True, torch.device("mps"), sharded=False)
    with pytest.raises(ValueError, match="cuda_graphs: the padded decode path reserves a null block"):
        ModelRunner(tiny_model, num_blocks=1, block_size=4, max_model_len=16, cuda_graphs=True)
    # Helper runners (the profile run's) stay dynamic unless asked.
    assert ModelRunner(tiny_model, num_blocks=4, block_size=4, max_model_len=16).static is None


def test_steps_the_padded_path_does_not_take(tiny_model: LoadedModel) -> None:
    """Prompt chunks, prompt logits, an unsampled one-token chunk and a batch past the largest
    bucket run the dynamic path."""
    runner = ModelRunner(tiny_model, num_blocks=40, block_size=4, max_model_len=16, cuda_graphs=True, max_num_seqs=2)
    static = runner.static
    assert static is not None
    runner.execute([ScheduledSeq([0], [5, 6], 0, True)])
    runner.execute([ScheduledSeq([1], [5], 0, True, prompt_logits=1)])
    runner.execute([ScheduledSeq([2], [5], 0, False)])
    runner.execute([ScheduledSeq([3 + i], [5], 0, True) for i in range(3)])
    assert static.num_steps == 0
    runner.execute([ScheduledSeq([0], [7], 2, True), ScheduledSeq([1], [7], 1, True)])
    assert static.num_steps == 1


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_replay_equal_eager(tiny_model_dir) -> None:
    from worker.model.loader import load_model

    loaded = load_model(tiny_model_dir, device="cuda", dtype="float32")
    kw: dict[str, Any] = dict(num_blocks=64, block_size=16, max_model_len=256, max_num_seqs=8)
    graphs = ModelRunner(loaded, cuda_graphs=True, **kw)
    eager = ModelRunner(loaded, cuda_graphs=False, **kw)
    assert graphs.static is not None and graphs.static.mode == "graphs"
    report = graphs.capture_report
    assert len(report.buckets) == len(graphs.static.buckets) * len(graphs.static.widths)
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(7)]
    lengths = [int(n) for n in torch.randint(1, 120, (7,), generator=gen)]
    for runner in (graphs, eager):
        for table, n in zip(tables, lengths):
            runner.execute([ScheduledSeq(table, list(range(20, 20 + n)), 0, False)])
    for step in range(6):
        rows = list(range(7 - step % 4))  # 7, 6, 5, 4 rows: buckets 8 and 4
        seqs = [ScheduledSeq(tables[i], [30 + step], lengths[i], True) for i in rows]
        torch.testing.assert_close(graphs.execute(seqs), eager.execute(seqs), rtol=0, atol=ATOL)
        for i in rows:
            lengths[i] += 1
    assert graphs.static.num_steps == 6 and graphs.static._graphs
