"""Load Hugging Face causal LMs for the runner, and build a tiny local Llama for tests and demos.

``load_model`` refuses (``ValueError``) every model the runner's attention function does not
compute exactly: it implements causal softmax attention with GQA, per-layer sliding windows and
logit softcapping, so sinks, MLA, chunked attention, linear/SSM hybrids and multi-axis RoPE are out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.config import DTYPE_NAMES
from worker.model.shard import ShardLayout

if TYPE_CHECKING:  # transformers loads lazily, in the functions that need it
    from transformers import (
        GenerationConfig,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

logger = logging.getLogger(__name__)

# Bump when the tiny model's recipe changes, so cached builds with the same arguments are redone.
_TINY_BUILD_VERSION = 1
_MARKER = "logitpool_tiny_model.json"

# Fixed stdlib files (relative to the stdlib dir) used as the tokenizer's training text.
_CORPUS_FILES = (
    "string.py",
    "textwrap.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "dataclasses.py",
    "functools.py",
    "heapq.py",
    "shutil.py",
    "argparse.py",
)
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner, with the facts the engine and sampler need about it."""

    model: PreTrainedModel  # in eval mode on `device`
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    eos_token_ids: frozenset[int]
    vocab_size: int  # width of the logits rows (the output projection), may exceed len(tokenizer)
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    # One rank's shard of a tensor-parallel group (worker.model.shard); None: the whole model.
    shard: ShardLayout | None = None


def default_model_path() -> Path:
    """Where the tiny test model is cached: ``$LOGITPOOL_CACHE`` or ``~/.cache/logitpool``."""
    root = os.environ.get("LOGITPOOL_CACHE") or Path.home() / ".cache" / "logitpool"
    return Path(root) / "tiny-llama"


# --------------------------------------------------------------------------- loading


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return "auto"
    try:
        return getattr(torch, DTYPE_NAMES[dtype])  # worker.config's table: names of torch dtypes
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of 'auto', {sorted(DTYPE_NAMES)}") from None


def auto_dtype(checkpoint: torch.dtype | None, device: torch.device, bf16_supported: bool) -> torch.dtype:
    """``dtype: auto``: the checkpoint's dtype, except a float32 one on a GPU runs in bfloat16
    (float16 where the GPU lacks bfloat16), as vLLM does: fp32 there doubles the bytes every
    decode step reads for no accuracy a served model needs. On CPU the checkpoint's dtype stays."""
    dtype = checkpoint or torch.float32
    if dtype == torch.float32 and device.type == "cuda":
        return torch.bfloat16 if bf16_supported else torch.float16
    return dtype


def load_dtype(dtype: str | torch.dtype | None, config: PretrainedConfig, device: torch.device) -> torch.dtype | str:
    """The dtype the weights load in. ``auto`` on a GPU is resolved here (``auto_dtype``) and said
    at start-up; elsewhere transformers resolves it, as before."""
    resolved = _resolve_dtype(dtype)
    if isinstance(resolved, torch.dtype) or device.type != "cuda":
        return resolved
    checkpoint = getattr(config.get_text_config(), "dtype", None) or getattr(config, "dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = getattr(torch, checkpoint)
    chosen = auto_dtype(checkpoint, device, torch.cuda.is_bf16_supported())
    if chosen != checkpoint:
        was, runs = (str(d).removeprefix("torch.") for d in (checkpoint or torch.float32, chosen))
        logger.info("dtype auto: a %s checkpoint runs in %s on %s (as vLLM does)", was, runs, device)
    return chosen


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` = CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def from_pretrained_kwargs(device: torch.device, dtype: torch.dtype | str) -> dict[str, object]:
    """On an accelerator the weights load straight onto it (``device_map``): through host RAM an
    8B model needs 16 GB of it per replica. On CPU nothing changes."""
    if device.type == "cpu":
        return {"dtype": dtype}
    return {"dtype": dtype, "device_map": device}


def unsupported_reason(config: PretrainedConfig) -> str | None:
    """Why the runner's attention cannot run this config exactly, or None when it can."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    modalities = [a for a in ("vision_config", "audio_config", "speech_config") if getattr(config, a, None)]
    if modalities:
        return f"multimodal models ({', '.join(modalities)}) are not supported"
    layer_types = getattr(text, "layer_types", None)
    supported = ("full_attention", "sliding_attention")
    if layer_types is not None and any(t not in supported for t in layer_types):
        kinds = sorted({t for t in layer_types if t not in supported})
        return f"layer types {kinds} (only {list(supported)} are supported)"
    for attr in ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "linear_attn_config"):
        if getattr(text, attr, None) is not None:
            return f"hybrid linear-attention/SSM models ({attr}) are not supported"
    if getattr(text, "kv_lora_rank", None) is not None or getattr(text, "q_lora_rank", None) is not None:
        return "multi-head latent attention (MLA) is not supported"
    v_dim, qk_dim = getattr(text, "v_head_dim", None), getattr(text, "qk_head_dim", None)
    if v_dim is not None and qk_dim is not None and v_dim != qk_dim:
        return "attention with different key and value head dims is not supported"
    if getattr(text, "attention_chunk_size", None) is not None:
        return "chunked local attention is not supported"
    if not getattr(text, "is_causal", True) or getattr(text, "use_bidirectional_attention", False):
        return "bidirectional attention is not supported"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if isinstance(rope, dict) and any(k in rope for k in ("mrope_section", "mrope_interleaved")):
        return "multi-axis (3D mrope) position ids are not supported"
    return None


def _model_reason(model: PreTrainedModel) -> str | None:
    if not getattr(model, "_supports_attention_backend", False):
        return (
            f"{type(model).__name__} does not pass attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False)"
        )
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        return "attention sinks are not supported"
    return None


def _eos_ids(generation_config: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(i) for i in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def supported_config(name: str) -> PretrainedConfig:
    """The model's config; ValueError when the runner cannot serve it exactly."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name)
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"model {name!r} ({config.model_type}) is not supported: {reason}")
    return config


def loaded_model(
    name: str, hf_model: PreTrainedModel, device: torch.device, *, vocab_size: int | None = None
) -> LoadedModel:
    """``hf_model`` (its weights on ``device``) with its tokenizer and facts; ValueError when the
    runner cannot serve it. ``vocab_size``: the full vocabulary of a model already sharded."""
    from transformers import AutoTokenizer

    reason = _model_reason(hf_model)
    if reason is not None:
        raise ValueError(f"model {name!r} ({hf_model.config.model_type}) is not supported: {reason}")
    hf_model = hf_model.to(device).eval()  # a no-op where the weights were placed on it
    tokenizer = AutoTokenizer.from_pretrained(name)
    text_config = hf_model.config.get_text_config()
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        config=hf_model.config,
        eos_token_ids=_eos_ids(getattr(hf_model, "generation_config", None), tokenizer),
        vocab_size=vocab_size or int(hf_model.get_output_embeddings().weight.shape[0]),
        max_model_len=int(text_config.max_position_embeddings),
        device=device,
        dtype=next(hf_model.parameters()).dtype,
    )


def load_model(
    model: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer (local path or hub id) through the real HF path.

    ``dtype`` None means float32; "auto" takes the checkpoint's dtype (a float32 one runs in
    bfloat16 on a GPU: ``auto_dtype``). ``device`` None means CUDA when available, else CPU.
    Raises ValueError for models the runner cannot serve exactly.
    """
    from transformers import AutoModelForCausalLM

    name = str(model)
    config = supported_config(name)
    target = resolve_device(device)
    hf_model = AutoModelForCausalLM.from_pretrained(
        name, **from_pretrained_kwargs(target, load_dtype(dtype, config, target))
    )
    return loaded_model(name, hf_model, target)


# --------------------------------------------------------------------------- tiny model


def _training_text() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / rel).read_text(encoding="utf-8") for rel in _CORPUS_FILES if (stdlib / rel).is_file()]
    if not texts:
        raise RuntimeError(f"no tokenizer training text found under {stdlib}")
    return texts


def _train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"],
    )
    wrapped.chat_template = _CHAT_TEMPLATE
    return wrapped


def _write_tiny_model(out: Path, args: dict[str, int]) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(args["vocab_size"])
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")]
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # the model must never emit ids the tokenizer lacks
        hidden_size=args["hidden_size"],
        intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"],
        num_key_value_heads=args["num_kv_heads"],
        max_position_embeddings=args["max_position_embeddings"],
        initializer_range=0.1,  # 0.02 gives near-tied logits and greedy loops: weak token-equality tests
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG stream
        torch.manual_seed(args["seed"])
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps(args, sort_keys=True))  # last: marks the build complete


def _is_built(path: Path, args: dict[str, int]) -> bool:
    marker = path / _MARKER
    return marker.is_file() and json.loads(marker.read_text()) == args


def build_tiny_model(
    path: str | Path,
    seed: int = 0,
    *,
    vocab_size: int = 3000,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 768,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a small random Llama + byte-level BPE tokenizer to ``path``; return ``path``.

    Deterministic for a given seed and Python stdlib (the tokenizer's training text). Idempotent:
    a directory already holding a build with the same arguments is returned as is. The build
    happens in a sibling temp dir and is renamed into place, so a reader never sees half a model.
    """
    path = Path(path)
    args = {
        "build_version": _TINY_BUILD_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }
    if _is_built(path, args):
        return path
    if path.exists() and any(path.iterdir()) and not (path / _MARKER).is_file():
        raise ValueError(f"{path} exists, is not empty and holds no tiny-model build; refusing to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        _write_tiny_model(tmp, args)
        if path.exists():  # an empty dir, or an older build of ours with other arguments
            if _is_built(path, args):  # a concurrent builder won the race
                return path
            shutil.rmtree(path)
        os.replace(tmp, path)
    except OSError:
        if not _is_built(path, args):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def embedded_model_path() -> Path:
    """The embedded tiny model, built on first use: what the CLI, the app, benches and tests run
    when no model is named (the engine itself always takes a named one)."""
    return build_tiny_model(default_model_path())


# --------------------------------------------------------------------------- limits

# Without an explicit max_model_len, KV is sized for at most this many tokens per sequence:
# a 128k-context model times max_num_seqs slots would not fit anywhere.
DEFAULT_MAX_MODEL_LEN_CAP = 4096


def resolve_max_model_len(configured: int | None, model_max: int) -> int:
    if configured is not None and configured > model_max:
        raise ValueError(f"max_model_len: {configured} exceeds the model's context ({model_max})")
    return configured if configured is not None else min(model_max, DEFAULT_MAX_MODEL_LEN_CAP)


def model_limits(model: str | Path, max_model_len: int | None = None) -> tuple[int, int]:
    """(vocab_size, max_model_len) from the config alone, for processes that load no weights."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(str(model)).get_text_config()
    return int(text.vocab_size), resolve_max_model_len(max_model_len, int(text.max_position_embeddings))
