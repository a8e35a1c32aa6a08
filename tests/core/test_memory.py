"""The C heap under MLX's CPU backend: freed arrays' memory serves the next arrays."""

from __future__ import annotations

import ctypes
import inspect
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from specd.core.memory import HEAP_TRIM_THRESHOLD, reuse_freed_memory

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


THREADS_HOLDING_BLOCKS = """
import gc, sys, threading
from specd.core.memory import heap_tops_returned, return_freed_memory, reuse_freed_memory

def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096

gc.disable()  # only return_freed_memory(cycles=True) collects
reuse_freed_memory()
threads, block = 8, 20 << 20  # each under the heap's trim threshold: it stays at a heap's top when freed
barrier = threading.Barrier(threads)
drained = sys.argv[1] == "drained"

def hold() -> None:
    held = [bytearray(block)]  # malloc'd by this thread, every page written
    barrier.wait()  # all blocks live at once, so that glibc gives the threads heaps of their own
    if drained:
        held.append(held)  # a cycle, as a drained engine's arrays are in: a collection frees it
    else:
        del held  # freed by its thread as it serves
    barrier.wait()

before = rss()
workers = [threading.Thread(target=hold) for _ in range(threads)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
if drained:
    with heap_tops_returned():
        return_freed_memory(cycles=True)
else:
    return_freed_memory()
print(rss() - before)
"""


def freed_blocks_kept(how: str) -> int:
    """Bytes of eight threads' 20 MB blocks, freed ``how``, still in RSS once handed back."""
    result = subprocess.run([sys.executable, "-c", THREADS_HOLDING_BLOCKS, how], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[2])
    return int(result.stdout)


@pytest.mark.skipif(not hasattr(LIBC, "mallinfo2"), reason="glibc's malloc only")
def test_threads_freed_blocks_go_back_to_the_os_but_for_a_heap_or_two():
    """Each thread that allocated while others did got a heap of its own, and glibc hands back
    (``malloc_trim``) free pages inside a heap but not the free space at a thread heap's top: eight
    threads' freed 20 MB blocks stayed in RSS. The threads now share two heaps: at most one thread
    heap's top stays."""
    kept = freed_blocks_kept("by-threads")
    assert kept <= HEAP_TRIM_THRESHOLD + (8 << 20), f"{kept / 2**20:.0f} MiB of 160 freed stayed in RSS"


@pytest.mark.skipif(not hasattr(LIBC, "mallinfo2"), reason="glibc's malloc only")
def test_a_drains_frees_hand_back_the_thread_heaps_top_too():
    """What a drained engine held is freed by the drain's collection: a thread heap's top that
    those frees join goes back to the OS with them, where a 20 MB block stayed at it before."""
    kept = freed_blocks_kept("drained")
    assert kept <= 8 << 20, f"{kept / 2**20:.0f} MiB of 160 freed stayed in RSS"


LOADS = """
import ctypes, sys
from mlx.utils import tree_flatten
from specd.core.loader import load_model

LIBC = ctypes.CDLL(None)
LIBC.mallinfo2.restype = MallInfo2
for _ in range(2):  # imports, the tokenizer's caches
    model, tokenizer = load_model(sys.argv[1])
weights = len(tree_flatten(model.parameters()))
del model, tokenizer
before = LIBC.mallinfo2().uordblks
for _ in range(10):
    model, tokenizer = load_model(sys.argv[1])
    del model, tokenizer
print((LIBC.mallinfo2().uordblks - before) / 10, weights)
"""


@pytest.mark.skipif(not hasattr(LIBC, "mallinfo2"), reason="glibc's malloc only")
def test_a_model_loaded_again_and_again_leaves_nothing_behind(forged):
    """mlx-lm builds a model with random weights before it reads the checkpoint's. Each draw
    split MLX's global key, which kept the graph of every split (about 2 KB a weight) until a
    draw from it was evaluated, which a serving daemon seldom does: each scale-to-zero cycle's
    load added its draws."""
    script = "import ctypes\n" + inspect.getsource(MallInfo2) + LOADS
    result = subprocess.run([sys.executable, "-c", script, str(forged / "target")], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[2])
    per_load, weights = map(float, result.stdout.split())
    assert per_load < 500 * weights, f"each load left {per_load / 1e3:.1f} kB in the C heap ({weights:.0f} weights)"
