"""Every library processor passes check_processor: each row equals that request run alone."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest

from worker.logits_processor.library import (
    DRYLogitsProcessor,
    EpsilonLogitsProcessor,
    EtaLogitsProcessor,
    MirostatLogitsProcessor,
    NoRepeatNgramLogitsProcessor,
    TopALogitsProcessor,
    TypicalPLogitsProcessor,
    XTCLogitsProcessor,
)
from worker.sampling_params import SamplingParams
from worker.testing import check_processor, random_params

V = 64

ARGS: dict[type, Callable[[random.Random], dict[str, Any]]] = {
    DRYLogitsProcessor: lambda r: {
        "dry_multiplier": r.choice([0.0, 0.8]),
        "dry_allowed_length": r.randint(1, 3),
        "dry_penalty_last_n": r.choice([-1, 5, 20]),
        "dry_sequence_breakers": r.choice([[], [[r.randrange(V)]], [[r.randrange(V), r.randrange(V)]]]),
    },
    EpsilonLogitsProcessor: lambda r: {"epsilon_cutoff": r.uniform(0.0, 0.05)},
    EtaLogitsProcessor: lambda r: {"eta_cutoff": r.uniform(0.0, 0.05)},
    MirostatLogitsProcessor: lambda r: {"mirostat": r.choice([0, 2]), "mirostat_tau": r.uniform(1, 6)},
    NoRepeatNgramLogitsProcessor: lambda r: {"no_repeat_ngram_size": r.randint(0, 4)},
    TopALogitsProcessor: lambda r: {"top_a": r.uniform(0.0, 1.0)},
    TypicalPLogitsProcessor: lambda r: {"typical_p": r.uniform(0.2, 1.0)},
    # Unseeded XTC rows share the processor's coin stream, so only seeded ones are batch-independent.
    XTCLogitsProcessor: lambda r: {"xtc_probability": r.uniform(0.2, 1.0), "xtc_threshold": r.uniform(0.01, 0.3)},
}


@pytest.mark.parametrize("cls", list(ARGS), ids=lambda c: c.__name__)
def test_conforms(cls: type) -> None:
    def make_params(rng: random.Random) -> SamplingParams:
        params = random_params(rng, V, extra_args=ARGS[cls](rng) if rng.random() < 0.7 else None)
        if cls is XTCLogitsProcessor and params.seed is None:
            params = dataclasses.replace(params, seed=rng.randrange(2**31))
        cls.validate_params(params)
        return params

    check_processor(cls, make_params=make_params, steps=200)
