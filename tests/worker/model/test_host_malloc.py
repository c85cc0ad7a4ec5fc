"""The CPU engine's malloc settings (worker.model.host_malloc): a large temporary comes from the
heap and is reused, where glibc's default maps each one afresh and unmaps it on free."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import ctypes, sys, torch
    from worker.model.host_malloc import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def mapped_while_held() -> int:
        before = libc.mallinfo2().hblkhd
        t = torch.empty(48 << 20, dtype=torch.uint8)  # 48 MiB: past glibc's largest default threshold
        during = libc.mallinfo2().hblkhd
        del t
        return during - before

    default = mapped_while_held()
    applied = keep_freed_memory()
    kept = mapped_while_held()
    print(default, applied, kept, keep_freed_memory())
    """
)


def test_a_cpu_engine_keeps_large_temporaries_in_the_heap() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    default, applied, kept, again = out.stdout.split()
    assert int(default) >= 48 << 20, "by default glibc maps a 48 MiB block of its own"
    assert applied == "True" and again == "True"  # once per process, idempotent
    assert int(kept) == 0, "with the settings it comes from the heap"


def test_a_cpu_runner_applies_them(tiny_model) -> None:
    from worker.model import host_malloc
    from worker.model.runner import ModelRunner

    ModelRunner(tiny_model, num_blocks=8, block_size=8)
    assert host_malloc._done == [True]
