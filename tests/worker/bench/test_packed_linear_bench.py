import pytest
import torch

from worker.bench.packed_linear import main


def test_gemm_table_has_a_row_per_m_and_says_which_are_packed(capsys: pytest.CaptureFixture[str]) -> None:
    threads = str(torch.get_num_threads())  # the bench sets torch's threads: keep the suite's
    assert main(["--gemms", "--rows", "8", "300", "--reps", "1", "--threads", threads]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["8", "300"]
    assert [r.split("|")[5].strip() for r in rows] == ["yes", "no"]
    for r in rows:
        plain, packed = (float(r.split("|")[i]) for i in (2, 3))
        assert plain > 0 and packed > 0
