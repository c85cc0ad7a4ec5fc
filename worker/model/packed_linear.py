"""CPU float32 linears on MKL's packed weights, in decode steps, at the rows where that is faster.

MKL's ``sgemm`` re-packs the weight into its panel layout on every call. At a decode step's few
rows that copy is a large part of the GEMM: MKL's packed GEMM (``cblas_sgemm_pack`` once, then
``sgemm_compute``; torch exposes it as ``torch.ops.mkl._mkl_linear``, what inductor uses for
frozen float32 weights) skips it. Measured on the 80M model's shapes, 2 threads (docs/benchmarks.md
"Packed weights on CPU"): 1.7-2.3x at 4-8 rows, 1.3-1.4x at 32-64, 1.1x at 128-256, no faster at
1-2 rows and barely past 256, where ``F.linear`` keeps the call; decode steps 1.1-1.2x. That is
one box's MKL: on an AVX2 AMD EPYC it is no faster at any row count (0.94-1.08x), another reason it
is opt-in. vLLM-cpu does the same with a prepacked oneDNN GEMM.

The numbers are torch's within float32 rounding, not bitwise (the packed kernel blocks the
reduction its own way), so a greedy near-tie may pick the other token: ``EngineConfig.packed_weights``
is opt-in, and only decode steps take it (``worker.model.runner.decode_only``), so prompt
logprobs and a prompt's KV stay torch's numbers.

The packed copy is a second copy of each weight (host memory: +1x the linears' weights). The
swap lives on the shared model object, but only a runner's forward turns it on (``packed_gemms``,
per thread): transformers' own ``generate()`` on the same model, or a runner with packing off,
runs ``F.linear`` as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

# Rows (tokens) of a call that take the packed kernel: measured faster at 4..256 (module docstring).
PACKED_ROWS = range(4, 257)
# The batch size MKL packs for; 64 was faster than 32 across 4..512 rows (the packed result is
# the same for any hint: only its speed differs).
PACK_HINT = 64

_state = threading.local()

Linear = Callable[[torch.Tensor], torch.Tensor]


def packed_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """MKL's packed GEMM runs here: float32 on a CPU, torch built with MKL and exposing the op."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def can_pack(weight: torch.Tensor) -> bool:
    """A 2-D weight where the packed GEMM runs."""
    return weight.dim() == 2 and packed_gemm_runs(weight.device, weight.dtype)


def resolve_packed_weights(packed_weights: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """``EngineConfig.packed_weights``: True where it cannot run is refused (one line, at start-up)."""
    if packed_weights and not packed_gemm_runs(device, dtype):
        raise ValueError(
            f"packed_weights: MKL's packed GEMM runs float32 on a CPU built with MKL; this model is {dtype} on {device}"
        )
    return packed_weights


@contextmanager
def packed_gemms(on: bool) -> Iterator[None]:
    """Packed linears take their packed kernel inside this block, on this thread, when ``on``."""
    before = getattr(_state, "on", False)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


class PackedLinear:
    """``F.linear(x, weight, bias)``; inside ``packed_gemms(True)`` at ``PACKED_ROWS`` rows, on the
    packed copy of ``weight``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.in_features = int(weight.shape[1])
        with torch.no_grad():
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows in PACKED_ROWS and getattr(_state, "on", False) and x.dtype == torch.float32:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """``F.linear`` on these weights (the fused layers' default)."""
    return lambda x: F.linear(x, weight, bias)


def linear_for(weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> Linear:
    """The linear a (fused) layer runs: packed where asked and the weight can be."""
    return PackedLinear(weight, bias) if packed and can_pack(weight) else plain_linear(weight, bias)


def pack_linears(model: nn.Module) -> int:
    """Give every plain, unswapped ``nn.Linear`` of ``model`` whose weight can be packed a
    ``PackedLinear`` forward, in place; idempotent. Returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is not nn.Linear or "forward" in vars(module) or not can_pack(module.weight):
            continue
        vars(module)["forward"] = PackedLinear(module.weight, module.bias)
        swapped += 1
    return swapped
