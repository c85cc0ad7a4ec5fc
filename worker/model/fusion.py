"""Fused layers: fewer, larger kernels per decoder layer, for the same numbers.

An eager transformers layer launches about 46 kernels; on a GPU at decode that launch rate, not
the weights, sets the step time, and on CPU each op pays the dispatcher. ``fuse_layers`` swaps,
module by module, only what is provably the same computation:

- on CUDA, an RMSNorm whose ``forward`` is Llama's (the same bytecode: Mistral's, Qwen's,
  SmolLM's, ...) becomes torch's fused ``rms_norm`` over float32: one kernel for five (on CPU
  torch composes ``rms_norm`` of as many ops, so it is left alone there);
- on CUDA, a gated MLP whose ``forward`` is Llama's (``down(act(gate(x)) * up(x))``) runs one GEMM
  over the concatenated ``[gate; up]`` weight (on CPU MKL runs the one [M, 768] x [768, 4096] GEMM
  no faster than the two of half the width and up to 20 % slower, M = 8..1024, the 80M model's
  shapes, docs/benchmarks.md "Fused layers on CPU"; so there it is left alone);
- q/k/v projections (three ``nn.Linear`` on the same input, biases alike) run one GEMM over
  ``[q; k; v]``: the ``q_proj`` call computes all three, the ``k_proj`` / ``v_proj`` calls on the
  same input tensor take their slice. Any other call (another input, one modified in place)
  computes its own projection, so the attention code around it need not be known.

A fused GEMM gives bitwise the same rows as the separate ones on CPU (the reduction runs along
K, which fusion does not split; tests/worker/model/test_fusion.py checks every family); on CUDA
cuBLAS may pick another tile for the wider matrix: bf16-level differences. The original
``nn.Linear`` weights become views into the fused ones (no second copy; state dicts unchanged).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.packed_linear import Linear, linear_for


@dataclass(frozen=True)
class FusionCounts:
    """How many modules of each kind ``fuse_layers`` swapped."""

    norms: int = 0
    mlps: int = 0
    qkv: int = 0

    def describe(self) -> str:
        return f"{self.norms} RMSNorms, {self.mlps} gate/up MLPs, {self.qkv} q/k/v projections fused"


def _llama_code() -> tuple[types.CodeType, types.CodeType]:
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    return LlamaRMSNorm.forward.__code__, LlamaMLP.forward.__code__


def _same_code(fn: object, ref: types.CodeType) -> bool:
    code = getattr(fn, "__code__", None)
    return (
        isinstance(code, types.CodeType)
        and code.co_code == ref.co_code
        and code.co_names == ref.co_names
        and code.co_consts == ref.co_consts
    )


# Where one [gate; up] GEMM beats two (see the module docstring for CPU).
FUSED_MLP_DEVICES = frozenset({"cuda"})


def fuse_layers(
    model: nn.Module, *, mlp_devices: frozenset[str] = FUSED_MLP_DEVICES, packed: bool = False
) -> FusionCounts:
    """Fuse what the model's family allows, in place, after the weights are on their device;
    idempotent (a swapped module is left alone). Gate/up fuse only on ``mlp_devices`` (tests pass
    ``{"cpu"}`` to check that swap's numbers on CPU). ``packed``: the fused GEMMs run on packed
    weights where they can (worker.model.packed_linear)."""
    norm_code, mlp_code = _llama_code()
    norms = mlps = qkv = 0
    for module in list(model.modules()):
        if "forward" in vars(module):  # already swapped
            continue
        cls_forward = type(module).forward
        weight = getattr(module, "weight", None)
        if _same_code(cls_forward, norm_code) and isinstance(weight, torch.Tensor) and weight.device.type == "cuda":
            _set_forward(module, _rms_norm(module))
            norms += 1
        elif _same_code(cls_forward, mlp_code):
            if _fuse_gate_up(module, mlp_devices, packed):
                mlps += 1
        elif _fuse_qkv(module, packed):
            qkv += 1
    return FusionCounts(norms, mlps, qkv)


def _set_forward(module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """An instance-level ``forward`` (``nn.Module.__call__`` runs it, hooks included)."""
    vars(module)["forward"] = forward


def _rms_norm(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """LlamaRMSNorm.forward in one kernel: float32 inside, the weight applied after the cast back."""
    eps = cast(float, module.variance_epsilon)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        normed = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=eps)
        return cast(torch.Tensor, module.weight) * normed.to(dtype)

    return forward


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """The named plain ``nn.Linear`` children, unswapped, reading inputs of one width, biases alike."""
    parts = [getattr(module, name, None) for name in names]
    linears = [p for p in parts if type(p) is nn.Linear and "forward" not in vars(p)]
    if len(linears) != len(names):
        return None
    first = linears[0].weight
    same = all(
        m.in_features == linears[0].in_features and m.weight.dtype == first.dtype and m.weight.device == first.device
        for m in linears
    )
    return linears if same and len({m.bias is None for m in linears}) == 1 else None


def _concat(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stacked weight (and bias); the originals become views into them (one copy of the
    weights, the state dict unchanged)."""
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        biases: list[torch.Tensor] = [m.bias for m in linears if m.bias is not None]
        bias = torch.cat(biases) if biases else None
    offset = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return weight, bias


def _fuse_gate_up(mlp: nn.Module, devices: frozenset[str], packed: bool) -> bool:
    linears = _linears(mlp, ("gate_proj", "up_proj"))
    down, act = getattr(mlp, "down_proj", None), getattr(mlp, "act_fn", None)
    if linears is None or not isinstance(down, nn.Module) or not callable(act):
        return False
    if linears[0].weight.device.type not in devices:
        return False
    gate_up = linear_for(*_concat(linears), packed)
    split = [m.out_features for m in linears]

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x).split(split, dim=-1)
        return cast(torch.Tensor, down(act(gate) * up))

    _set_forward(mlp, forward)
    return True


class _SharedProjection:
    """One GEMM for the q/k/v linears of an attention module; each call takes its slice.

    The result for the last input is kept until every slice was taken (then dropped, so no
    step's activations outlive its layer); a call on another input, or on the same tensor
    changed in place since (where torch tracks it: not for inference tensors, which no
    attention code modifies between its projections), computes afresh.
    """

    def __init__(self, linear: Linear, sizes: list[int]) -> None:
        self.linear = linear
        self.sizes = sizes
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: list[torch.Tensor | None] = [None] * len(sizes)

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        out = self._outputs[index]
        version = -1 if x.is_inference() else x._version  # inference tensors keep no counter
        if out is None or self._input is not x or self._version != version:
            self._input, self._version = x, version
            self._outputs = list(self.linear(x).split(self.sizes, dim=-1))
            out = self._outputs[index]
        assert out is not None
        self._outputs[index] = None
        if all(o is None for o in self._outputs):
            self._input = None
        return out

    def slice_of(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: self.take(index, x)


def _fuse_qkv(attn: nn.Module, packed: bool) -> bool:
    linears = _linears(attn, ("q_proj", "k_proj", "v_proj"))
    if linears is None:
        return False
    shared = _SharedProjection(linear_for(*_concat(linears), packed), [m.out_features for m in linears])
    for index, linear in enumerate(linears):
        _set_forward(linear, shared.slice_of(index))
    return True
