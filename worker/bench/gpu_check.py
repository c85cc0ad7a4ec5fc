"""`make gpu-check`: does the pool run right on a GPU, and how near the memory floor it decodes.

On a CUDA machine (torch, transformers and triton installed, no network; run from the source
tree on PYTHONPATH, nothing is reinstalled) it builds an 8B-shaped random Llama directly on
the device in bfloat16 and prints one table:

- fp32 greedy tokens equal transformers' ``generate()`` exactly (on a smaller shape: fp32),
- bf16 top-1 agreement with transformers (its forward over the engine's own continuation),
- seeded sampling gives the same tokens in two fresh engines,
- the KV pool the engine sized itself (``worker.model.memory``: a share of the total memory),
- each decode engine's start-up (profile, KV pool, graph capture) in seconds,
- decode tokens/s at batch 1 / 32 / 256 (1k-token contexts, greedy) with CUDA graphs on (async
  scheduling on, then off), off, and off with the flex backend; the step's host ms (wall time
  less the GPU's busy time: what the GPU waits on the host), host reads and kernels per step,
  and the memory floor (weights + the KV a step reads, over the bandwidth measured by a device
  copy) as a ratio of the step.

Exit 0 when the correctness rows pass, 1 when one fails, 2 without a CUDA device (one line).
``--smoke`` runs the same steps at tiny shapes on CPU (CI runs it: tests/worker/bench).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.engine import LLMEngine
    from worker.model.loader import LoadedModel
    from worker.sampling_params import SamplingParams

# What the engine imports beyond torch and transformers; small wheels to carry to a GPU host.
NEEDED = ("pydantic", "xgrammar", "tokenizers", "numpy", "accelerate")  # accelerate: device_map loads
BLOCK_SIZE = 16
# The decode-rate engines, one after another: the padded path as CUDA graphs (on CPU eagerly)
# with async scheduling and without, the dynamic path with the torch backend, and with flex
# (opt-in until measured here).
DECODE_VARIANTS: dict[str, dict[str, object]] = {
    "graphs on": {"cuda_graphs": True, "async_scheduling": True},
    "graphs on, sync": {"cuda_graphs": True, "async_scheduling": False},  # what the overlap gains
    "graphs off": {"cuda_graphs": False},
    "flex, graphs off": {"cuda_graphs": False, "attention_backend": "flex"},
}


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int
    init_std: float  # wide enough that top-1 is rarely a near-tie (a random model's logits)

    def describe(self) -> str:
        return f"hidden {self.hidden}, {self.layers} layers, heads {self.heads}/{self.kv_heads} kv, vocab {self.vocab}"


LLAMA_8B = Shape(4096, 14336, 32, 32, 8, 128256, 8192, 0.02)


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the full GPU check or the CPU smoke run."""

    big: Shape  # bf16: agreement, seeded runs, decode rates
    exact: Shape  # fp32 greedy = generate()
    exact_prompts: int
    exact_prompt_len: int
    agree_prompts: int
    agree_prompt_len: int
    seeded_prompts: int
    new_tokens: int  # generated per request in the three correctness checks
    batches: tuple[int, ...]
    context: int  # prompt tokens of each decode-rate request
    warm_steps: int
    timed_steps: int
    profiled_steps: int  # steps under torch.profiler (GPU busy time), 0 on CPU
    copy_bytes: int  # of the bandwidth probe's buffer

    @property
    def decode_steps(self) -> int:
        """Steps each decode-rate request runs past its prefill: warm-up, timed, profiled, and
        the one whose syncs are counted."""
        return self.warm_steps + self.timed_steps + self.profiled_steps + 1


FULL = Plan(
    big=LLAMA_8B,
    exact=Shape(1024, 2816, 4, 16, 4, 32000, 2048, 0.1),
    exact_prompts=4,
    exact_prompt_len=128,
    agree_prompts=4,
    agree_prompt_len=1024,
    seeded_prompts=4,
    new_tokens=32,
    batches=(1, 32, 256),
    context=1024,
    warm_steps=2,
    timed_steps=32,
    profiled_steps=3,
    copy_bytes=2**30,
)
TINY = Shape(128, 256, 2, 4, 2, 1024, 512, 0.1)
SMOKE = Plan(
    big=TINY,
    exact=TINY,
    exact_prompts=2,
    exact_prompt_len=16,
    agree_prompts=2,
    agree_prompt_len=32,
    seeded_prompts=2,
    new_tokens=6,
    batches=(1, 4, 8),
    context=48,
    warm_steps=1,
    timed_steps=3,
    profiled_steps=0,
    copy_bytes=32 * 2**20,
)


@dataclass(frozen=True)
class Row:
    check: str
    result: str
    detail: str
    ok: bool = True  # False fails the run (exit 1)


# --------------------------------------------------------------------------- the model


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _tokenizer(vocab: int):  # -> PreTrainedTokenizerFast
    """A word-level tokenizer of ``vocab`` made-up tokens: instant at any size, decodes every id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0")


def build_llama(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LoadedModel:
    """A random Llama of ``shape``, created on ``device`` in ``dtype`` (never staged in host RAM)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.model.loader import LoadedModel

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        initializer_range=shape.init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(config).eval()
    return LoadedModel(
        model=model,
        tokenizer=_tokenizer(shape.vocab),
        config=model.config,
        eos_token_ids=frozenset({2}),
        vocab_size=shape.vocab,
        max_model_len=shape.max_positions,
        device=device,
        dtype=dtype,
    )


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _engine(
    loaded: LoadedModel, max_num_seqs: int, max_model_len: int, *, pool_tokens: int | None, **fields: object
) -> LLMEngine:
    """An engine on ``loaded``: a KV pool of ``pool_tokens`` tokens, or None = sized from the
    device; ``fields``: more EngineConfig fields (the decode variants')."""
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.model.runner import block_bytes

    kv = None
    if pool_tokens is not None:
        kv = (math.ceil(pool_tokens / BLOCK_SIZE) + max_num_seqs) * block_bytes(loaded, BLOCK_SIZE)
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(8192 if loaded.device.type == "cuda" else 2048, max_num_seqs),
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=kv,
        load_entry_points=False,
        **fields,  # type: ignore[arg-type]  # EngineConfig's own fields, checked by it
    )
    return LLMEngine(cfg, loaded=loaded)


def _generate(engine: LLMEngine, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
    ids = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    return [tokens[rid] for rid in ids]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- the checks


def exact_greedy(plan: Plan, device: torch.device) -> Row:
    """fp32: the engine's greedy tokens are transformers' generate() tokens, exactly. The model
    is saved as a checkpoint and loaded back through ``load_model``, the serving path (weights
    straight onto the device through transformers' ``device_map``)."""
    import tempfile

    from worker.model.loader import load_model
    from worker.sampling_params import SamplingParams

    built = build_llama(plan.exact, torch.float32, device, seed=1)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as checkpoint:
        built.model.save_pretrained(checkpoint)
        built.tokenizer.save_pretrained(checkpoint)
        del built
        _free(device)
        loaded = load_model(checkpoint, device=device, dtype="float32")
    k, n = plan.new_tokens, plan.exact_prompts
    prompts = _prompts(n, plan.exact_prompt_len, plan.exact.vocab, seed=2)
    engine = _engine(loaded, n, plan.exact_prompt_len + k, pool_tokens=n * (plan.exact_prompt_len + k))
    ours = _generate(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)] * n)
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False
            )
            theirs.append(out[0, len(p) :].tolist())
    equal = sum(a == b for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, t, strict=True))
    same = ours == theirs
    detail = f"{n} prompts x {k} tokens, {plan.exact.describe()}, via load_model: {equal}/{n * k} tokens equal"
    del engine, loaded
    _free(device)
    return Row("fp32 greedy = transformers generate()", "ok" if same else "FAIL", detail, same)


def bf16_agreement(plan: Plan, loaded: LoadedModel) -> Row:
    """bf16: how often transformers' top-1, over the engine's own greedy continuation, is the
    engine's token (kernels differ, so near-ties may flip; a bug shows as far lower)."""
    from worker.sampling_params import SamplingParams

    k, n = plan.new_tokens, plan.agree_prompts
    prompts = _prompts(n, plan.agree_prompt_len, plan.big.vocab, seed=3)
    engine = _engine(loaded, n, plan.agree_prompt_len + k, pool_tokens=n * (plan.agree_prompt_len + k))
    ours = _generate(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)] * n)
    del engine
    _free(loaded.device)
    agree = 0
    with torch.inference_mode():
        for p, o in zip(prompts, ours, strict=True):
            ids = torch.tensor([p + o], device=loaded.device)
            logits = loaded.model(input_ids=ids, logits_to_keep=k + 1).logits[0, :-1]
            agree += int((logits.argmax(-1).cpu() == torch.tensor(o)).sum())
    share = agree / (n * k)
    ok = share >= 0.9
    detail = f"{n} prompts of {plan.agree_prompt_len} tokens x {k}: {agree}/{n * k} positions (ok at >= 0.90)"
    return Row("bf16 top-1 agreement with transformers", f"{'ok' if ok else 'LOW'} {share:.3f}", detail, ok)


def seeded_runs(plan: Plan, loaded: LoadedModel) -> Row:
    """Seeded sampling is reproducible: the same tokens from two fresh engines."""
    from worker.sampling_params import SamplingParams

    k, n = plan.new_tokens, plan.seeded_prompts
    prompts = _prompts(n, plan.exact_prompt_len, plan.big.vocab, seed=4)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=100 + i, max_tokens=k) for i in range(n)]
    runs = []
    for _ in range(2):
        engine = _engine(loaded, n, plan.exact_prompt_len + k, pool_tokens=n * (plan.exact_prompt_len + k))
        runs.append(_generate(engine, prompts, params))
        del engine
        _free(loaded.device)
    same = runs[0] == runs[1]
    detail = f"{n} requests (temperature 1, top-p 0.9, top-k 50), {sum(map(len, runs[0]))} tokens"
    return Row("seeded runs, two fresh engines", "ok" if same else "FAIL", detail, same)


def bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


@dataclass(frozen=True)
class StepProfile:
    busy_ms: float | None  # the GPU's kernel and copy time per step; None where unknown
    kernels: int | None  # kernels run per step (on a GPU each a launch, or a node of a graph)


def _profile_steps(device: torch.device, step: Callable[[], object], steps: int) -> StepProfile:
    """Per step: the GPU's busy time (torch.profiler, CUDA) and the kernels run; on CPU the
    kernels a step dispatches (``worker.bench.fusion.count_kernels``)."""
    if device.type != "cuda":
        from worker.bench.fusion import count_kernels

        return StepProfile(None, count_kernels(step))
    if steps < 1:
        return StepProfile(None, None)
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
        kernels = sum(
            e.count for e in events if e.device_type == DeviceType.CUDA and not e.key.startswith(("Memcpy", "Memset"))
        )
        return StepProfile(busy, kernels // steps)
    except Exception:  # noqa: BLE001 - no CUPTI here: the row says n/a
        return StepProfile(None, None)


def _other_syncs(device: torch.device, step: Callable[[], object]) -> int | None:
    """Host syncs in one steady-state step besides its one read (``to_host`` lifts the mode for
    that copy): what ``torch.cuda.set_sync_debug_mode("warn")`` reports. None off CUDA."""
    if device.type != "cuda":
        return None
    import warnings

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return sum("synchroniz" in str(w.message) for w in caught)


def decode_rate(
    plan: Plan, engine: LLMEngine, loaded: LoadedModel, batch: int, bytes_per_s: float, variant: str
) -> Row:
    """Greedy decode of ``batch`` rows at ``plan.context`` tokens of context, on ``variant``'s engine."""
    from worker.model.memory import weight_bytes
    from worker.model.runner import kv_shape
    from worker.ops.host_sync import total_host_reads
    from worker.sampling_params import SamplingParams

    device = loaded.device
    params = SamplingParams(temperature=0.0, max_tokens=plan.decode_steps + 2, ignore_eos=True)
    ids = [
        engine.add_request(f"d{batch}-{i}", p, params)
        for i, p in enumerate(_prompts(batch, plan.context, plan.big.vocab, 5))
    ]
    started: set[str] = set()
    while len(started) < batch:  # prefill: until every row has its first token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(plan.warm_steps):
        engine.step()
    _sync(device)
    reads0, t0 = total_host_reads(), time.perf_counter()
    for _ in range(plan.timed_steps):
        engine.step()
    _sync(device)
    step_ms = (time.perf_counter() - t0) * 1e3 / plan.timed_steps
    reads = (total_host_reads() - reads0) / plan.timed_steps
    prof = _profile_steps(device, engine.step, plan.profiled_steps)
    syncs = _other_syncs(device, engine.step)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    layers, kv_heads, head_dim = kv_shape(loaded)
    context = plan.context + plan.warm_steps + plan.timed_steps / 2
    read = weight_bytes(loaded.model) + batch * context * 2 * layers * kv_heads * head_dim * loaded.dtype.itemsize
    floor_ms = read / bytes_per_s * 1e3
    if device.type == "cpu":
        host = "all host (CPU)"
    elif prof.busy_ms is None:
        host = "host n/a (no GPU timer)"
    else:
        host = f"host {max(0.0, step_ms - prof.busy_ms):.1f} ms (GPU busy {prof.busy_ms:.1f})"
    kernels = "n/a" if prof.kernels is None else str(prof.kernels)
    detail = f"step {step_ms:.1f} ms, {host}, {reads:g} host reads/step, {kernels} kernels/step"
    if syncs is not None:
        detail += f", {syncs} other syncs/step"
    detail += f", floor {floor_ms:.2f} ms: {floor_ms / step_ms:.2f} of the floor"
    check = f"decode batch {batch} ({plan.context} context), {variant}"
    return Row(check, f"{batch * 1e3 / step_ms:,.0f} tok/s", detail)


# --------------------------------------------------------------------------- main


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _table(header: str, rows: Sequence[Row]) -> str:
    lines = [header, "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {r.check} | {r.result} | {r.detail} |" for r in rows]
    return "\n".join(lines)


def _decode_variant(
    plan: Plan, loaded: LoadedModel, variant: str, fields: dict[str, object], bytes_per_s: float, *, pool_row: bool
) -> list[Row]:
    """One decode engine's rows: its start-up (and the KV pool it sized), then each batch's rate."""
    t0 = time.perf_counter()
    engine = _engine(loaded, max(plan.batches), plan.context + plan.decode_steps + 8, pool_tokens=None, **fields)
    started = time.perf_counter() - t0
    rows = []
    if pool_row:
        budget = engine.kv_budget
        pool = _size(engine.runner.kv_cache_bytes)
        rows.append(Row("KV pool", pool, budget.describe() if budget else "CPU: max_num_seqs x max_model_len"))
    report = engine.runner.capture_report
    captured = f"; {report.describe()}" if report else ""
    rows.append(Row(f"engine start-up, {variant}", f"{started:.1f} s", f"profile, KV pool{captured}"))
    return rows + [decode_rate(plan, engine, loaded, b, bytes_per_s, variant) for b in plan.batches]


def run(plan: Plan, device: torch.device) -> list[Row]:
    from worker.model.memory import weight_bytes

    rows = [exact_greedy(plan, device)]
    t0 = time.perf_counter()
    loaded = build_llama(plan.big, torch.bfloat16, device)
    _sync(device)
    built = time.perf_counter() - t0
    weights = weight_bytes(loaded.model)
    what = "8B-shaped model" if plan.big == LLAMA_8B else "model"
    rows.append(Row(f"{what} built on {device.type}", f"{_size(weights)} bf16", f"{built:.1f} s"))
    rows.append(bf16_agreement(plan, loaded))
    rows.append(seeded_runs(plan, loaded))
    bytes_per_s = bandwidth(device, plan.copy_bytes)
    _free(device)
    copied = f"{plan.copy_bytes >> 20} MiB"
    rows.append(Row("memory bandwidth (device copy)", f"{bytes_per_s / 1e9:,.0f} GB/s", copied))
    for variant, fields in DECODE_VARIANTS.items():
        try:  # each engine sized as in production, alone on the device (the last one freed first)
            rows += _decode_variant(plan, loaded, variant, fields, bytes_per_s, pool_row=variant == "graphs on")
        except Exception as exc:  # noqa: BLE001  # a variant that fails is a row, and the run goes on
            rows.append(Row(f"decode, {variant}", "fails", f"{type(exc).__name__}: {exc}"[:300], ok=False))
        _free(device)
    return rows


def _missing() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the same steps at tiny shapes, on CPU (seconds)")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device (torch {torch.__version__} sees none); --smoke runs it on CPU", file=sys.stderr
        )
        return 2
    missing = _missing()
    if missing:
        print(
            f"gpu-check: python packages missing here: {', '.join(missing)} (pip install --no-deps their wheels)",
            file=sys.stderr,
        )
        return 2
    plan, device = (SMOKE, torch.device("cpu")) if args.smoke else (FULL, torch.device("cuda"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    t0 = time.perf_counter()
    rows = run(plan, device)
    header = f"gpu-check on {name}, torch {torch.__version__}: {plan.big.describe()}, {time.perf_counter() - t0:.0f} s"
    print(_table(header, rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
