"""Tensor-parallel shards of a transformers causal LM, in place, on one rank of a group.

Which weights split and how is the model family's own ``base_model_tp_plan`` (transformers'
tensor-parallel plan): ``colwise`` linears (q/k/v, gate/up) keep a slice of their outputs,
``rowwise`` ones (o, down) a slice of their inputs, ``packed_colwise`` expert weights (gate and up
packed in one tensor) a slice of each half. The plan is applied with plain tensor slices, not
transformers' DTensor path, so the paged attention sees ordinary per-rank tensors: the q heads
of a rank and the KV heads they read (split across ranks; replicated where there are fewer KV
heads than ranks). Each decoder sublayer holding a row-parallel weight (attention, MLP or MoE
block) all-reduces its output once, before the residual add and any post-norm. The embedding is
vocab-parallel (each rank looks up its rows, then an all-reduce) and the lm_head's vocab slices are
gathered to rank 0, which alone gets the full ``(rows, vocab)`` logits.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# Plan entries that leave a weight whole on every rank (inference needs no gradient all-reduce).
_REPLICATED = frozenset({"moe_tp_experts", "replicated_with_grad_allreduce"})
_SPLIT = frozenset({"colwise", "rowwise", "packed_colwise"})


@dataclass
class CommStats:
    """One rank's collectives since start, by kind: calls, bytes sent into them, seconds in them."""

    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def timed(self, kind: str, tensor: torch.Tensor, run: Callable[[], object]) -> None:
        start = time.perf_counter()
        run()
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class ShardLayout:
    """Which heads (and slices) rank ``rank`` of ``world_size`` holds."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: PretrainedConfig, rank: int, world_size: int) -> ShardLayout:
        text = config.get_text_config()
        heads = int(text.num_attention_heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        if heads % world_size:
            raise ValueError(f"tensor_parallel_size: {world_size} does not divide the {heads} attention heads")
        if kv % world_size and world_size % kv:
            raise ValueError(
                f"tensor_parallel_size: {world_size} neither divides the {kv} KV heads nor is a multiple of them"
            )
        return cls(rank, world_size, heads, kv, head_dim)

    @property
    def kv_heads_per_rank(self) -> int:
        """Split when the ranks divide them; else one replicated head per rank."""
        return self.num_kv_heads // self.world_size if self.num_kv_heads % self.world_size == 0 else 1

    def q_heads(self) -> range:
        n = self.num_heads // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self) -> range:
        """The KV heads this rank's q heads read (GQA groups are contiguous)."""
        first = self.q_heads().start // (self.num_heads // self.num_kv_heads)
        return range(first, first + self.kv_heads_per_rank)

    def even(self, size: int) -> range:
        """This rank's slice of ``size`` (MLP width, vocab): the first ``size % world`` get one more."""
        base, extra = divmod(size, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))


def _heads(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _plan(model: PreTrainedModel) -> dict[str, str]:
    plan = getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(
            f"tensor_parallel_size: {type(model).__name__} has no tensor-parallel plan (base_model_tp_plan)"
        )
    unknown = sorted({s for s in plan.values() if s not in _SPLIT | _REPLICATED})
    if unknown:
        raise ValueError(f"tensor_parallel_size: {type(model).__name__}'s plan uses {unknown}, not supported")
    return plan


def _style(plan: dict[str, str], name: str) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    return None


def _out_range(name: str, rows: int, layout: ShardLayout) -> range:
    """The output rows a rank keeps of a column-parallel weight."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "q_proj":
        return _heads(layout.q_heads(), layout.head_dim)
    if leaf in ("k_proj", "v_proj"):
        return _heads(layout.kv_heads(), layout.head_dim)
    return layout.even(rows)


def _in_range(name: str, cols: int, layout: ShardLayout) -> range:
    """The input columns a rank keeps of a row-parallel weight (those its column slices produce)."""
    return _heads(layout.q_heads(), layout.head_dim) if name.endswith("o_proj") else layout.even(cols)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


@dataclass(frozen=True)
class Cut:
    """One parameter's shard on one rank: the slices of the full tensor it keeps, concatenated
    along ``dim`` (two for packed gate/up experts), or zeros (a row-parallel bias on rank > 0: the
    bias is added once, by rank 0). The one rule both loaders follow: slicing a loaded tensor
    (``apply``) and reading only the slice from a checkpoint (``take`` with a safetensors slice)."""

    parts: tuple[tuple[slice, ...], ...]
    dim: int = 0
    zero: bool = False

    def take(self, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
        """The shard from ``read`` (given each part's index); a zero cut reads nothing."""
        if self.zero:
            raise ValueError("a zero cut reads nothing: build its zeros from the parameter's shape")
        pieces = [read(p) for p in self.parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(full) if self.zero else self.take(lambda idx: full[idx])


def _along(dim: int, r: range, ndim: int) -> tuple[slice, ...]:
    """The index keeping ``r`` of dimension ``dim`` (negative: from the end) and all of the others."""
    idx = [slice(None)] * ndim
    idx[dim] = slice(r.start, r.stop)
    return tuple(idx)


def _linear_cuts(name: str, module: nn.Linear, style: str, layout: ShardLayout) -> dict[str, Cut]:
    w = module.weight
    if style == "colwise":
        r = _out_range(name, w.shape[0], layout)
        cuts = {"weight": Cut((_along(0, r, 2),))}
        if module.bias is not None:
            cuts["bias"] = Cut((_along(0, r, 1),))
        return cuts
    # rowwise: partial sums, added up by the sublayer's all-reduce; the bias once (rank 0)
    r = _in_range(name, w.shape[1], layout)
    cuts = {"weight": Cut((_along(1, r, 2),))}
    if module.bias is not None and layout.rank:
        cuts["bias"] = Cut((), zero=True)
    return cuts


def _shard_linear(name: str, module: nn.Linear, style: str, layout: ShardLayout) -> dict[str, Cut]:
    cuts = _linear_cuts(name, module, style, layout)
    for leaf, cut in cuts.items():
        setattr(module, leaf, _param(cut.apply(getattr(module, leaf))))
    if style == "colwise":
        module.out_features = module.weight.shape[0]
    else:
        module.in_features = module.weight.shape[1]
    return cuts


def _expert_cut(w: torch.Tensor, style: str, layout: ShardLayout) -> Cut:
    """Fused expert weights: ``gate_up_proj`` [E, 2I, H] (packed_colwise), ``down_proj`` [E, H, I] (rowwise)."""
    if style == "packed_colwise":
        half = w.shape[1] // 2
        r = layout.even(half)
        second = range(half + r.start, half + r.stop)
        return Cut((_along(1, r, w.dim()), _along(1, second, w.dim())), dim=1)
    return Cut((_along(-1, layout.even(w.shape[-1]), w.dim()),))


def _shard_expert_param(owner: nn.Module, leaf: str, style: str, layout: ShardLayout) -> Cut:
    w = getattr(owner, leaf)
    cut = _expert_cut(w, style, layout)
    setattr(owner, leaf, _param(cut.apply(w)))
    if style == "packed_colwise" and hasattr(owner, "intermediate_dim"):
        owner.intermediate_dim = len(layout.even(w.shape[1] // 2))  # type: ignore[assignment]  # an int attribute nn.Module types loosely
    return cut


def _all_reduce_hook(stats: CommStats) -> Callable[[nn.Module, Any, Any], Any]:
    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        """A sublayer's partial sums, added over the ranks (the output is a tensor or a tuple)."""
        t = output[0] if isinstance(output, tuple) else output
        stats.timed("all_reduce", t, lambda: dist.all_reduce(t))
        return output

    return hook


def _vocab_parallel_embedding(embed: nn.Embedding, layout: ShardLayout, stats: CommStats) -> Cut:
    r = layout.even(embed.weight.shape[0])
    cut = Cut((_along(0, r, 2),))
    embed.weight = _param(cut.apply(embed.weight))
    inner = embed.forward  # the family's own (a scaled embedding scales: linear, so it commutes)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < r.start) | (ids >= r.stop)
        out = inner((ids - r.start).masked_fill(outside, 0))
        out = out.masked_fill(outside[..., None], 0.0)
        stats.timed("all_reduce", out, lambda: dist.all_reduce(out))
        return out

    embed.forward = forward  # type: ignore[method-assign, assignment]  # the instance's forward, not the class's
    return cut


def _gathered_lm_head(
    head: nn.Linear, vocab: int, layout: ShardLayout, tied: nn.Parameter | None, stats: CommStats
) -> dict[str, Cut]:
    r = layout.even(vocab)
    cuts = {"weight": Cut((_along(0, r, 2),))}
    head.weight = tied if tied is not None else _param(cuts["weight"].apply(head.weight))
    if head.bias is not None:
        cuts["bias"] = Cut((_along(0, r, 1),))
        head.bias = _param(cuts["bias"].apply(head.bias))
    sizes = [len(dataclasses.replace(layout, rank=i).even(vocab)) for i in range(layout.world_size)]
    width = sizes[0]  # rank 0's slice is the widest: every slice pads to it for the gather
    inner = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        local = inner(hidden)
        if local.shape[-1] < width:
            local = nn.functional.pad(local, (0, width - local.shape[-1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in sizes] if layout.rank == 0 else None
        stats.timed("gather", local, lambda: dist.gather(local, parts, dst=0))
        if parts is None:
            return local  # other ranks' logits are never read
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    head.forward = forward  # type: ignore[method-assign, assignment]  # as the embedding's
    return cuts


def _sublayer(name: str) -> str:
    """``layers.<i>.<sublayer>`` of a weight's name: the module that all-reduces its partial sums."""
    parts = name.split(".")
    i = next(k for k, p in enumerate(parts) if p.isdigit())
    return ".".join(parts[: i + 2])


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def shard_model(model: PreTrainedModel, layout: ShardLayout, stats: CommStats) -> dict[str, Cut]:
    """Cut ``model`` down to rank ``layout.rank``'s shard, in place; collectives join the forward
    (and are counted in ``stats``). Returns each split parameter's cut by its name in ``model``
    (the rest stay whole): on a meta-device skeleton, what ``worker.model.shard_loader`` reads."""
    plan = _plan(model)
    base = model.base_model
    prefix = _name_of(model, base)
    full = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    cuts: dict[str, Cut] = {}
    row_parallel: set[str] = set()
    for name, module in list(base.named_modules()):
        style = _style(plan, name)
        if isinstance(module, nn.Linear) and style in _SPLIT:
            for leaf, cut in _shard_linear(name, module, style, layout).items():
                cuts[full(f"{name}.{leaf}")] = cut
            if style == "rowwise":
                row_parallel.add(_sublayer(name))
        for leaf, _ in list(module.named_parameters(recurse=False)):
            leaf_style = _style(plan, f"{name}.{leaf}")
            if leaf_style in _SPLIT:
                cuts[full(f"{name}.{leaf}")] = _shard_expert_param(module, leaf, leaf_style, layout)
                if leaf_style == "rowwise":
                    row_parallel.add(_sublayer(name))
    for sub in sorted(row_parallel):
        base.get_submodule(sub).register_forward_hook(_all_reduce_hook(stats))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_name, head_name = _name_of(model, embed), _name_of(model, head)
    tied = head.weight is embed.weight
    vocab = int(head.weight.shape[0])
    cuts[f"{embed_name}.weight"] = _vocab_parallel_embedding(embed, layout, stats)
    for leaf, cut in _gathered_lm_head(head, vocab, layout, embed.weight if tied else None, stats).items():
        cuts[f"{head_name}.{leaf}"] = cut
    return cuts
