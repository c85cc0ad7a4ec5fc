"""`logitpool bench processors` runs every library processor and reports multiples of a copy pass."""

from __future__ import annotations

import torch

from worker.bench.processors import TYPICAL_EXTRA_ARGS, _Step, main, typical_args
from worker.logits_processor.library import LIBRARY_PROCESSORS, TopALogitsProcessor
from worker.logits_processor.schema import declared_keys
from worker.sampling_params import SamplingParams


def test_every_library_processor_has_bench_args_that_validate() -> None:
    for cls in LIBRARY_PROCESSORS:
        extra = typical_args(cls)
        assert extra, f"{cls.__name__}: no key of it in TYPICAL_EXTRA_ARGS"
        cls.validate_params(SamplingParams(extra_args=extra))
    declared = set().union(*(declared_keys(c) or () for c in LIBRARY_PROCESSORS))
    assert set(TYPICAL_EXTRA_ARGS) <= declared  # no key of a processor that is gone


def test_ten_percent_enables_a_tenth_of_the_rows() -> None:
    proc = TopALogitsProcessor(None, torch.device("cpu"), False)
    _Step([proc], typical_args(TopALogitsProcessor), 0.1, 50, 64, seed=0)
    assert len(proc.states) == 5


def test_main_prints_a_row_per_case(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        assert (
            main(["--batch-size", "8", "--vocab-size", "128", "--warmup", "0", "--repeats", "1", "--threads", "1"]) == 0
        )
    finally:
        torch.set_num_threads(threads)  # main sets it for the process
    table = capsys.readouterr().out.split("\n\n")[-1]
    for cls in LIBRARY_PROCESSORS:
        assert f"| {cls.__name__} | 100% |" in table and f"| {cls.__name__} | 10% |" in table
    assert "| all 8 loaded, unused | 0% |" in table
