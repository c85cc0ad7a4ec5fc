"""Offline batch inference: ``LLM(model).generate(prompts, params)`` with no Ray."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tqdm.auto import tqdm

from worker.config import EngineConfig
from worker.engine import LLMEngine, Prompt
from worker.model.loader import LoadedModel, embedded_model_path
from worker.outputs import OutputAccumulator, RequestOutput
from worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Show a progress bar from this many prompts on (short runs stay quiet).
_PROGRESS_MIN_PROMPTS = 16


class LLM:
    # The defaults are EngineConfig's own (its class attributes), stated there once.
    def __init__(
        self,
        model: str | None = None,
        *,
        logits_processors: Sequence[str | type] = (),
        max_num_seqs: int = EngineConfig.max_num_seqs,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        max_model_len: int | None = EngineConfig.max_model_len,
        device: str | None = EngineConfig.device,
        dtype: str = EngineConfig.dtype,
        seed: int = EngineConfig.seed,
        tensor_parallel_size: int = EngineConfig.tensor_parallel_size,
        loaded: LoadedModel | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if model is None and loaded is None:  # offline use with no model named: the embedded one
            model = str(embedded_model_path())
        config = EngineConfig(
            model=model,
            logits_processors=tuple(logits_processors),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            device=device,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            **engine_kwargs,
        )
        self.engine = LLMEngine(config, loaded=loaded)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        Every request is validated (standard rules and every processor's ``validate_params``)
        before any is admitted: one bad request raises ValueError and nothing runs.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        parents = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                parents.append(self.engine.prepare(None, prompt, params))
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from exc
        order = {p.request_id: i for i, p in enumerate(parents)}
        accumulators = {p.request_id: OutputAccumulator() for p in parents}
        results: list[RequestOutput | None] = [None] * len(parents)
        for parent in parents:
            self.engine.add_prepared(parent)
        bar = tqdm(total=len(parents), desc="generate", disable=not use_tqdm or len(parents) < _PROGRESS_MIN_PROMPTS)
        with bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    out = accumulators[delta.request_id].add(delta)
                    if delta.finished:
                        results[order[delta.request_id]] = out
                        bar.update(1)
        return [r for r in results if r is not None]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], int):  # one prompt of token ids
        return [cast(list[int], items)]
    return cast(list[Prompt], items)
