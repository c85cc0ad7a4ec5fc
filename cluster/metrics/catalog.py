"""The request metrics' names and buckets, logitpool's and vLLM's, in one table.

vLLM's are vLLM v1's exactly (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`): the names,
the `model_name` label and the bucket bounds, so a vLLM Grafana dashboard's
`histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))`
or an autoscaling rule on `vllm:num_requests_waiting` reads a logitpool deployment unchanged.
docs/metrics.md lists every metric with where it is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Names = Literal["logitpool", "vllm", "both"]  # config `metrics.names` (cluster.config.MetricsConfig)
VLLM_PREFIX = "vllm:"

# vLLM v1's bucket bounds (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets (its `build_1_2_5_buckets`): 1, 2, 5, 10, 20, 50, ... up to
    ``max_value`` (the model's context length)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class Spec:
    """One request metric: its name in the ingress's registry. A logitpool name has vLLM twins
    (the same observations): its own name with `vllm:` for `logitpool_`, plus ``also``. A name
    that starts with `vllm:` is vLLM's only (logitpool counts the same elsewhere, in another shape)."""

    name: str
    doc: str
    also: tuple[str, ...] = ()

    @property
    def vllm(self) -> tuple[str, ...]:
        if self.name.startswith(VLLM_PREFIX):
            return ()
        return (VLLM_PREFIX + self.name.removeprefix("logitpool_"), *self.also)


TTFT = Spec("logitpool_time_to_first_token_seconds", "Seconds from dispatch to a sequence's first token")
# vLLM 0.11 renamed time_per_output_token_seconds to inter_token_latency_seconds; dashboards use both.
INTER_TOKEN = Spec(
    "logitpool_inter_token_latency_seconds",
    "Seconds between a sequence's tokens (a message of k tokens counts k gaps of 1/k of its wait)",
    ("vllm:time_per_output_token_seconds",),
)
TIME_PER_OUTPUT_TOKEN = Spec(
    "logitpool_request_time_per_output_token_seconds",
    "Per finished sequence: seconds from its first token to its last, over its tokens after the first",
)
E2E = Spec("logitpool_e2e_request_latency_seconds", "Seconds from dispatch to a sequence's end")
QUEUE = Spec("logitpool_request_queue_time_seconds", "Seconds a sequence waited in its worker's engine")
PROMPT_TOKENS = Spec("logitpool_request_prompt_tokens", "Prompt tokens per finished sequence")
GENERATION_TOKENS = Spec("logitpool_request_generation_tokens", "Generated tokens per finished sequence")
PROMPT_TOKENS_TOTAL = Spec("logitpool_prompt_tokens", "Prompt tokens of sequences that produced a first token")
# logitpool's own: logitpool_generated_tokens (by protocol, per answered request) and
# logitpool_sequences_finished (by reason, counted by the engines).
GENERATION_TOKENS_TOTAL = Spec("vllm:generation_tokens", "Generated tokens, as they reach the ingress")
SUCCESS = Spec("vllm:request_success", "Sequences ended, by finish reason (abort: the stream was cut off)")


def shown(name: str, names: Names) -> list[str]:
    """The names a registry family ``name`` is served under, as ``names`` selects: a vLLM-only
    family unless `logitpool`; a logitpool family with vLLM twins under its own name unless
    `vllm` and under theirs unless `logitpool`; any other family always, under its own."""
    if name not in BY_NAME:
        return [name]
    if name.startswith(VLLM_PREFIX):
        return [] if names == "logitpool" else [name]
    aliases = BY_NAME[name].vllm
    return ([] if names == "vllm" else [name]) + ([] if names == "logitpool" else list(aliases))


BY_NAME = {
    s.name: s
    for s in (
        TTFT,
        INTER_TOKEN,
        TIME_PER_OUTPUT_TOKEN,
        E2E,
        QUEUE,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        PROMPT_TOKENS_TOTAL,
        GENERATION_TOKENS_TOTAL,
        SUCCESS,
    )
}
