"""Per-rank loading: a tensor-parallel rank reads only its shard from the checkpoint (issue 15, item 5).

Each family's tiny random fp32 checkpoint (the model matrix's recipe) is loaded for both ranks of
2 by ``load_shard`` and by the whole-checkpoint path (``load_then_slice``, the reference): the
parameters and buffers must be equal bitwise, and the bytes taken through ``get_slice`` must be
exactly the rank's own parameters (about half the checkpoint), never the whole of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.test_model_matrix import _build
from worker.model.loader import LoadedModel
from worker.model.shard import CommStats, ShardLayout
from worker.model.shard_loader import ReadStats, load_shard, load_then_slice

CPU = torch.device("cpu")


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral_window", "gemma2"])
def test_a_rank_reads_only_its_shard(family: str, tmp_path: Path, tiny_model: LoadedModel) -> None:
    _build(family, tmp_path, tiny_model.tokenizer)
    checkpoint = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    total_read = 0
    for rank in range(2):
        reads = ReadStats()
        got = load_shard(str(tmp_path), "float32", CPU, rank, 2, CommStats(), reads)
        want = load_then_slice(str(tmp_path), "float32", CPU, ShardLayout.of(got.config, rank, 2), CommStats())
        assert reads.fallback is None, reads.fallback
        params, ref = dict(got.model.named_parameters()), dict(want.model.named_parameters())
        assert params.keys() == ref.keys()
        assert all(torch.equal(params[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(params[k], ref[k])]
        buffers, ref_buffers = dict(got.model.named_buffers()), dict(want.model.named_buffers())
        assert buffers.keys() == ref_buffers.keys()
        assert all(torch.equal(buffers[k], v) and buffers[k].dtype == v.dtype for k, v in ref_buffers.items())
        tied = want.model.get_output_embeddings().weight is want.model.get_input_embeddings().weight
        assert (got.model.get_output_embeddings().weight is got.model.get_input_embeddings().weight) == tied
        assert (got.vocab_size, got.eos_token_ids) == (want.vocab_size, want.eos_token_ids)
        shard = _bytes(list(params.values()))  # fp32 checkpoint, fp32 model: the same bytes
        assert reads.bytes <= shard, "a rank read more than its shard"
        assert reads.bytes < 0.6 * checkpoint  # half the weights, plus the replicated norms
        total_read += reads.bytes
    assert total_read >= 0.95 * checkpoint  # between them the ranks read every weight (the rest: the file header)


def test_converted_checkpoints_load_whole_and_say_why(tmp_path: Path, tiny_model: LoadedModel) -> None:
    """Qwen3-MoE's per-expert checkpoint keys are fused on load by transformers: today's path, named."""
    _build("qwen3_moe", tmp_path, tiny_model.tokenizer)
    reads = ReadStats()
    got = load_shard(str(tmp_path), "float32", CPU, 1, 2, CommStats(), reads)
    assert reads.fallback is not None and "conversion mapping" in reads.fallback and reads.bytes == 0
    assert got.shard == ShardLayout.of(got.config, 1, 2)
