"""DoubleBuffer: host buffers of a non-blocking copy are rewritten only once that copy is done.

CUDA events cannot run here, so the event is a recording stand-in (the one CUDA part); the
buffers, copies and the batch / structured-output processor using them are real.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.batch import PersistentBatch
from worker.logits_processor.structured import StructuredOutputsLogitsProcessor
from worker.ops.staging import DoubleBuffer
from worker.sampling_params import SamplingParams

CPU = torch.device("cpu")


class RecordingEvent:
    """Stands in for torch.cuda.Event: logs record / synchronize into a shared list."""

    def __init__(self, log: list[tuple[str, int]], ident: int) -> None:
        self.log, self.ident = log, ident

    def record(self) -> None:
        self.log.append(("record", self.ident))

    def synchronize(self) -> None:
        self.log.append(("wait", self.ident))


def recording(log: list[tuple[str, int]]):
    made = iter(range(100))
    return lambda: RecordingEvent(log, next(made))


def test_halves_alternate_and_each_reuse_waits_for_its_last_copy() -> None:
    log: list[tuple[str, int]] = []
    buf = DoubleBuffer(torch.int32, CPU, pin_memory=False, event_factory=recording(log))
    ptrs = []
    outs = []
    for step in range(6):
        host = buf.host(4, 3)
        log.append(("handed", step))
        ptrs.append(host.data_ptr())
        host.fill_(step)
        outs.append(buf.to_device(host))
    # Two halves, used in turn.
    assert ptrs[0] != ptrs[1] and ptrs[0::2] == [ptrs[0]] * 3 and ptrs[1::2] == [ptrs[1]] * 3
    # Half 0's copy recorded event 0, half 1's event 1; handing a half out again waits on its
    # event first (before "handed"), and the first use of each half waits on nothing.
    assert log == [
        ("handed", 0), ("record", 0),
        ("handed", 1), ("record", 1),
        ("wait", 0), ("handed", 2), ("record", 0),
        ("wait", 1), ("handed", 3), ("record", 1),
        ("wait", 0), ("handed", 4), ("record", 0),
        ("wait", 1), ("handed", 5), ("record", 1),
    ]  # fmt: skip
    # What went to the device never aliases a buffer: later fills leave it as it was.
    assert [int(o.unique().item()) for o in outs] == list(range(6))
    assert all(o.data_ptr() not in ptrs for o in outs)


def test_a_half_grows_when_asked_for_more() -> None:
    buf = DoubleBuffer(torch.float32, CPU, pin_memory=False)
    small = buf.to_device(buf.host(2))
    big = buf.host(5, 7)
    assert big.shape == (5, 7) and big.is_contiguous()
    big.copy_(torch.arange(35.0).view(5, 7))
    assert torch.equal(buf.to_device(big), torch.arange(35.0).view(5, 7)) and small.shape == (2,)


def test_stage_copies_through_the_next_half() -> None:
    buf = DoubleBuffer(torch.int64, CPU, pin_memory=False)
    src = torch.tensor([3, 1, 4])
    out = buf.stage(src)
    src[0] = 9
    assert out.tolist() == [3, 1, 4]


def test_the_batch_stages_its_sampling_columns_through_double_buffers() -> None:
    """A column rewritten by the next update never reaches a metadata built before it."""
    batch = PersistentBatch(4)
    batch.update([], [("a", SamplingParams(temperature=0.5), [1], [])])
    first = batch.sampling_metadata()
    batch.update(["a"], [("b", SamplingParams(temperature=0.25), [1], [])])
    second = batch.sampling_metadata()
    batch.update(["b"], [("c", SamplingParams(temperature=0.75), [1], [])])
    third = batch.sampling_metadata()
    assert [first.temperature.item(), second.temperature.item(), third.temperature.item()] == [0.5, 0.25, 0.75]
    assert all(isinstance(b, DoubleBuffer) for b in batch._staging.values())


def test_the_grammar_bitmask_goes_through_a_double_buffer() -> None:
    """Its rows are filled on the host every step: the structured processor's pair (the masks
    it applies are checked in tests/worker/test_structured.py)."""
    proc = StructuredOutputsLogitsProcessor(None, CPU, False)
    assert isinstance(proc._bitmask, DoubleBuffer) and proc._bitmask.dtype == torch.int32


@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=300))
def test_int64_tensor_equals_torch_tensor(values: list[int]) -> None:
    from worker.ops.staging import int64_tensor

    got = int64_tensor(values)
    assert got.dtype == torch.int64 and got.shape == (len(values),)
    assert got.tolist() == values
    values.append(7)  # the tensor does not alias the list
    assert got.tolist() == values[:-1]
