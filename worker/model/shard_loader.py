"""One tensor-parallel rank's weights, read straight from the checkpoint: only its shard.

The model is built as a skeleton on the meta device (transformers' own init contexts: no
memory, no init), cut to the rank's shapes by ``shard_model`` (which names each split
parameter's ``Cut``: the one slicing rule), and every parameter is then read from the safetensors
files through ``get_slice`` with its cut (a whole read for replicated ones: norms, MoE routers),
cast to the dtype and placed on the rank's device. Non-persistent buffers (rotary ``inv_freq``,
Gemma's ``embed_scale``) are then recomputed by the family's own ``_init_weights``, as
``from_pretrained`` recomputes them. A 70B model no longer needs 140 GB of host RAM per rank.

Families whose checkpoint keys are not the model's parameter names one to one (transformers
converts them on load: fused MoE experts of Qwen3-MoE / Mixtral, renamed legacy keys), and
checkpoints not in safetensors, load whole on the host and are sliced (``load_then_slice``); the
start-up log says which and why.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from worker.model.loader import LoadedModel, load_dtype, load_model, loaded_model, supported_config
from worker.model.shard import CommStats, Cut, ShardLayout, shard_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass
class ReadStats:
    """What one rank took from the checkpoint: bytes (in the checkpoint's dtype) and tensors."""

    bytes: int = 0
    tensors: int = 0
    # None: read per rank; else why the whole checkpoint was loaded and sliced.
    fallback: str | None = None


def checkpoint_files(path: Path) -> dict[str, Path] | None:
    """Each tensor's safetensors file in a local checkpoint directory; None when it has none."""
    index = path / _INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {key: path / file for key, file in weight_map.items()}
    single = path / _SINGLE
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _why_not_per_rank(name: str, config: PretrainedConfig, skeleton: PreTrainedModel, keys: set[str]) -> str | None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    if get_checkpoint_conversion_mapping(config.model_type) is not None:
        return f"{config.model_type}'s checkpoint keys are converted on load (transformers' conversion mapping)"
    missing = [owners[0] for owners in _owners(skeleton).values() if not any(o in keys for o in owners)]
    if missing:
        return f"{len(missing)} parameters are not checkpoint keys of {name!r} (e.g. {missing[0]!r})"
    return None


def _owners(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter's names (a tied one has several), by the parameter's identity."""
    owners: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname)
    return owners


def _skeleton(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The model on the meta device, with transformers' own init contexts (dtype, no init)."""
    from transformers import AutoModelForCausalLM

    model_cls = AutoModelForCausalLM._model_mapping[type(config)]
    with ExitStack() as stack:
        for ctx in model_cls.get_init_context(dtype, False, False, None):
            stack.enter_context(ctx)
        model = model_cls(config)
    model.tie_weights()  # tied embeddings share one parameter, as after from_pretrained
    return model


@contextmanager
def _readers(files: dict[str, Path]) -> Iterator[dict[Path, Any]]:
    from safetensors import safe_open

    with ExitStack() as stack:
        yield {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())}


def _set(model: nn.Module, pname: str, value: nn.Parameter) -> None:
    owner, _, leaf = pname.rpartition(".")
    setattr(model.get_submodule(owner), leaf, value)


def load_then_slice(name: str, dtype: str, device: torch.device, layout: ShardLayout, stats: CommStats) -> LoadedModel:
    """The whole checkpoint on the host, sliced to the rank's shard, then moved to its device."""
    loaded = load_model(name, device="cpu", dtype=dtype)
    shard_model(loaded.model, layout, stats)
    loaded.model.to(device)
    return replace(loaded, device=device, shard=layout)


def load_shard(
    name: str, dtype: str, device: torch.device, rank: int, world_size: int, stats: CommStats, reads: ReadStats
) -> LoadedModel:
    """Rank ``rank``'s shard of model ``name`` on ``device``, reading only that shard where the
    family's checkpoint allows (``reads`` says what was read, or why all of it was)."""
    config = supported_config(name)
    layout = ShardLayout.of(config, rank, world_size)
    files = checkpoint_files(Path(name)) if Path(name).is_dir() else None
    if files is None:
        reads.fallback = f"{name!r} is not a local safetensors checkpoint"
    else:
        resolved = load_dtype(dtype, config, device)
        target = getattr(config, "dtype", None) if resolved == "auto" else resolved
        skeleton = _skeleton(config, target if isinstance(target, torch.dtype) else torch.float32)
        reads.fallback = _why_not_per_rank(name, config, skeleton, set(files))
    if reads.fallback is not None:
        logger.info("tensor parallel rank %d: loading the whole checkpoint, then slicing: %s", rank, reads.fallback)
        return load_then_slice(name, dtype, device, layout, stats)
    assert files is not None
    vocab = int(skeleton.get_output_embeddings().weight.shape[0])
    cuts = shard_model(skeleton, layout, stats)
    with _readers(files) as readers:
        for owners in _owners(skeleton).values():
            meta = skeleton.get_parameter(owners[0])
            key = next(o for o in owners if o in files)
            value = _read(readers[files[key]], key, cuts.get(next((o for o in owners if o in cuts), "")), meta, reads)
            param = nn.Parameter(value.to(device=device, dtype=meta.dtype), requires_grad=False)
            param._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' init skips it
            for o in owners:
                _set(skeleton, o, param)
    _init_buffers(skeleton, device)
    _generation_config(skeleton, name)
    return replace(loaded_model(name, skeleton, device, vocab_size=vocab), shard=layout)


def _read(reader: Any, key: str, cut: Cut | None, meta: torch.Tensor, reads: ReadStats) -> torch.Tensor:
    """``key``'s shard (all of it without a cut) through ``get_slice``, counted in ``reads``."""
    if cut is not None and cut.zero:
        return torch.zeros(meta.shape, dtype=meta.dtype)
    sl = reader.get_slice(key)

    def read(idx: tuple[slice, ...]) -> torch.Tensor:
        t = sl[idx]
        reads.bytes += t.numel() * t.element_size()
        reads.tensors += 1
        return t

    value = read(tuple(slice(None) for _ in sl.get_shape())) if cut is None else cut.take(read)
    if value.shape != meta.shape:
        raise ValueError(f"checkpoint tensor {key!r}: shard {tuple(value.shape)}, the model wants {tuple(meta.shape)}")
    return value


def _generation_config(model: PreTrainedModel, name: str) -> None:
    """The checkpoint's generation config (its EOS ids), as ``from_pretrained`` reads it."""
    from transformers import GenerationConfig

    if (Path(name) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(name)


def _init_buffers(model: PreTrainedModel, device: torch.device) -> None:
    """Buffers off the meta device, recomputed by the family's ``_init_weights`` (rotary
    ``inv_freq``, scales): the loaded parameters are marked initialised, so they stay."""
    for bname, buf in list(model.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = bname.rpartition(".")
            module = model.get_submodule(owner)
            persistent = leaf not in module._non_persistent_buffers_set
            module.register_buffer(leaf, torch.empty_like(buf, device=device), persistent=persistent)
    model.initialize_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"tensor parallel: {left[:3]} are still on the meta device after loading")
