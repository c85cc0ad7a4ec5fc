"""`logitpool bench processors` runs every library processor and reports multiples of a copy pass."""

from __future__ import annotations

import torch

from worker.bench.processors import ARGS, _Step, main
from worker.logits_processor.library import LIBRARY_PROCESSORS, TopALogitsProcessor


def test_every_library_processor_has_bench_args_that_validate() -> None:
    assert set(ARGS) == set(LIBRARY_PROCESSORS)
    from worker.sampling_params import SamplingParams

    for cls, extra in ARGS.items():
        cls.validate_params(SamplingParams(extra_args=extra))


def test_ten_percent_enables_a_tenth_of_the_rows() -> None:
    proc = TopALogitsProcessor(None, torch.device("cpu"), False)
    _Step([proc], ARGS[TopALogitsProcessor], 0.1, 50, 64, seed=0)
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
