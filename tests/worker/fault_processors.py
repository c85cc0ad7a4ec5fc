"""TEST FIXTURES: processors that force tokens, write NaN or raise, to exercise docs/sampling.md "The nine steps"'s
non-finite rules and the engine's failure isolation. Each reads one ``extra_args`` key, so the
rows that enable it are exactly the ones a fault should stay with.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.logits_processor import BatchUpdate, LogitsProcessor
from worker.logits_processor.state import RowStates


class _PerRow(LogitsProcessor):
    """Keeps ``extra_args[KEY]`` per row through adds, removes and moves (``RowStates``)."""

    KEY = ""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: RowStates[Any] = RowStates(lambda params, _prompt, _out: (params.extra_args or {}).get(self.KEY))

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.rows.update(batch_update)


class ForceTokensProcessor(_PerRow):
    """``extra_args={"force": [ids]}``: those tokens get +inf (vLLM's examples force this way)."""

    KEY = "force"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, ids in self.rows.items():
            logits[row, ids] = float("inf")
        return logits


class NaNProcessor(_PerRow):
    """``extra_args={"nan": true}``: writes NaN into the row's first logit."""

    KEY = "nan"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, _ in self.rows.items():  # noqa: PERF102 - RowStates is not a dict: .items() gives (row, state)
            logits[row, 0] = float("nan")
        return logits


class ArmedUpdateStateProcessor(_PerRow):
    """Raises in ``update_state`` for every batch change while the class is ``armed`` (all rows)."""

    armed = False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None and type(self).armed:
            raise RuntimeError("ArmedUpdateStateProcessor: armed")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class FlakyApplyProcessor(_PerRow):
    """``apply`` raises once after the class is ``armed``: a fault no replay reproduces."""

    armed = False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if type(self).armed:
            type(self).armed = False
            raise RuntimeError("FlakyApplyProcessor: raised once")
        return logits


class ExitAtStartProcessor(_PerRow):
    """Kills its process when the engine builds it (a core that dies during start-up, as a
    segfault or the OOM killer would: no traceback to send)."""

    KEY = "exit_at_start"

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        import os

        os._exit(7)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
