"""Request latency and size, measured at the ingress as its requests' tokens arrive.

The ingress sees what a client sees: when a sequence's first token, each later one and its end
reach it from the worker, counted from the moment the front end dispatched the request (after
parsing, validation and tokenization: vLLM's clock also starts when its engine gets the request,
after its front end's preprocessing). Queue time is the worker's: its engine reports it on the
sequence's last output (`CompletionOutput.queue_time_s`). One observation per sequence (a prompt's
`n` completions are `n`), as vLLM v1 counts its child requests.
"""

from __future__ import annotations

import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Histogram

from cluster.metrics import catalog as c
from worker.outputs import RequestOutput

LABELS = ["model_name", "ingress"]


class RequestSeries:
    """The ingress replica's request histograms and counters (cluster.metrics.catalog), bound to
    its labels: the served model and this ingress replica."""

    def __init__(self, registry: CollectorRegistry, model_name: str, replica: str, max_model_len: int) -> None:
        self._labels = (model_name, replica)
        tokens = c.buckets_1_2_5(max_model_len)

        def histogram(spec: c.Spec, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(spec.name, spec.doc, LABELS, buckets=buckets, registry=registry).labels(*self._labels)

        def counter(spec: c.Spec) -> Counter:
            return Counter(spec.name, spec.doc, LABELS, registry=registry).labels(*self._labels)

        self.ttft = histogram(c.TTFT, c.TTFT_BUCKETS)
        self.inter_token = histogram(c.INTER_TOKEN, c.TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(c.TIME_PER_OUTPUT_TOKEN, c.TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram(c.E2E, c.REQUEST_LATENCY_BUCKETS)
        self.queue = histogram(c.QUEUE, c.REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram(c.PROMPT_TOKENS, tokens)
        self.generation_tokens = histogram(c.GENERATION_TOKENS, tokens)
        self.prompt_tokens_total = counter(c.PROMPT_TOKENS_TOTAL)
        self.generation_tokens_total = counter(c.GENERATION_TOKENS_TOTAL)
        self._success = Counter(c.SUCCESS.name, c.SUCCESS.doc, [*LABELS, "finished_reason"], registry=registry)

    def finished(self, reason: str) -> None:
        self._success.labels(*self._labels, reason).inc()


class SequenceClock:
    """The sequences of one dispatched prompt (its ``n`` completions), timed as their deltas
    arrive; `close` when the stream ends, however it ends."""

    def __init__(self, series: RequestSeries, prompt_tokens: int, n: int) -> None:
        self.series = series
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.start = time.monotonic()
        self._first: dict[int, float] = {}  # by completion index: when its first token arrived
        self._last: dict[int, float] = {}  # ... and its latest
        self._tokens: defaultdict[int, int] = defaultdict(int)
        self._ended: set[int] = set()
        self._started = False

    def add(self, delta: RequestOutput) -> None:
        now = time.monotonic()
        self._started = True
        s = self.series
        for out in delta.outputs:
            i = out.index
            if i in self._ended:
                continue
            k = len(out.token_ids)
            if k:
                s.generation_tokens_total.inc(k)
                if i not in self._first:
                    self._first[i] = now
                    s.ttft.observe(now - self.start)
                    s.prompt_tokens_total.inc(self.prompt_tokens)
                else:  # k tokens arrived together: k gaps of an equal share (their sum is the wait)
                    gap = (now - self._last[i]) / k
                    for _ in range(k):
                        s.inter_token.observe(gap)
                self._last[i] = now
                self._tokens[i] += k
            if out.finish_reason is not None:
                self._end(i, out.finish_reason, now, out.queue_time_s)

    def _end(self, i: int, reason: str, now: float, queue_time_s: float | None) -> None:
        s = self.series
        self._ended.add(i)
        s.finished(reason)
        s.e2e.observe(now - self.start)
        tokens = self._tokens[i]
        s.prompt_tokens.observe(self.prompt_tokens)
        s.generation_tokens.observe(tokens)
        if tokens > 1:
            s.time_per_output_token.observe((self._last[i] - self._first[i]) / (tokens - 1))
        if queue_time_s is not None:
            s.queue.observe(queue_time_s)

    def close(self) -> None:
        """A stream cut off after it started (the client went away, a timeout, a failure): its
        unfinished sequences count as aborted; one that never started counts nowhere."""
        if self._started:
            for i in range(self.n):
                if i not in self._ended:
                    self._ended.add(i)
                    self.series.finished("abort")
