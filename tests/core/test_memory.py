"""The C heap under MLX's CPU backend: freed arrays' memory serves the next arrays."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import pytest

from specd.core.memory import reuse_freed_memory

LIBC = ctypes.CDLL(None)


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


if hasattr(LIBC, "mallinfo2"):
    LIBC.mallinfo2.restype = MallInfo2


def mapped_blocks() -> int:
    """Blocks glibc's malloc holds in mappings of their own, in the whole process."""
    return LIBC.mallinfo2().hblks


@pytest.mark.skipif(not hasattr(LIBC, "mallinfo2") or mx.default_device() != mx.cpu,
                    reason="glibc's malloc under MLX's CPU backend only")
def test_arrays_a_little_larger_each_time_come_from_the_heap():
    """A conversation's attention scores grow a little every turn: each used to be above glibc's
    mmap threshold of the moment, so it was mapped (and zeroed page by page) and unmapped anew."""
    reuse_freed_memory()
    before = mapped_blocks()
    mapped = []
    for step in range(1, 40):
        scores = mx.ones((step * 70_000,), dtype=mx.float32)  # 0.27 to 10.7 MB
        mx.eval(scores)
        mapped.append(mapped_blocks() - before)
        del scores
    assert mapped == [0] * len(mapped), mapped
