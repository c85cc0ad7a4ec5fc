"""FaultInjectionProcessor: a logits processor that fails on request, for soak and isolation tests.

A request enables it with ``extra_args={"fault": KIND}``:
- ``"apply"``: ``apply`` raises while that request is in the batch;
- ``"update_state"``: ``update_state`` raises in the step that adds the request;
- ``"nan"``: ``apply`` writes NaN into that request's row.
Requests without the key are untouched. Load it by FQCN
(``worker.bench.faults:FaultInjectionProcessor``); it ships in the package so ``logitpool bench
soak`` can load it on a real deployment.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.logits_processor.state import RowStates
from worker.sampling_params import SamplingParams

FQCN = "worker.bench.faults:FaultInjectionProcessor"
KINDS = ("apply", "update_state", "nan")


class InjectedFault(RuntimeError):
    """Raised on purpose; never a bug."""


def _kind(params: SamplingParams) -> str | None:
    return (params.extra_args or {}).get("fault")


class FaultInjectionProcessor(LogitsProcessor):
    extra_args_keys = ("fault",)

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: RowStates[str] = RowStates(lambda params, _prompt, _out: _kind(params))

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        kind = _kind(params)
        if kind is not None and kind not in KINDS:
            raise ValueError(f"extra_args.fault: must be one of {KINDS}, got {kind!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self._rows.update(batch_update)
        if batch_update is not None and any(_kind(p) == "update_state" for _, p, _, _ in batch_update.added):
            raise InjectedFault("injected fault in update_state")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, kind in self._rows.items():
            if kind == "apply":
                raise InjectedFault(f"injected fault in apply (row {row})")
            if kind == "nan":
                logits[row] = float("nan")
        return logits
