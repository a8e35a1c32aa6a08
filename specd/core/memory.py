"""The host's memory, as MLX can use it, and the C heap under MLX's CPU backend."""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx


def host_memory_bytes() -> int:
    """Memory MLX may use on this host: on a Mac, Metal's recommended working
    set (unified memory less what macOS keeps for itself); elsewhere, physical memory."""
    if mx.metal.is_available():
        return int(mx.metal.device_info()["max_recommended_working_set_size"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def gib(n: int) -> str:
    """Bytes as people read them: GiB, or MiB below a quarter of one."""
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"


_LIBC = ctypes.CDLL(None)
_MALLOPT = getattr(_LIBC, "mallopt", None)  # glibc only
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
# Blocks below this come from the heap, where a freed one serves the next array alike (glibc's own
# ceiling for the threshold it raises as it goes)
HEAP_MMAP_THRESHOLD = 32 << 20
# The free space at a heap's top that stays for the next arrays (what a step frees, the next asks for
# again): as much as one block the heap serves, as more stays in RSS for little (``ops/bench/kv_memory.py``);
# the daemon hands free pages back on its own clock (``return_freed_memory``)
HEAP_TRIM_THRESHOLD = 32 << 20
# Heaps the threads share (glibc's default: eight per core). ``malloc_trim`` hands back free pages
# inside every heap but the free space at the top of a thread's own heap, which stays resident up
# to the trim threshold: with one such heap for each thread that allocated while another did (the
# engines', the executor pools', MLX's), eight threads' freed blocks stayed resident whole
# (``tests/core/test_memory.py``). Not one: the engine's thread and MLX's would then wait on its lock
# (``ops/bench/results/cluster_soak_one_heap.json``)
HEAP_ARENAS = 2
# glibc's own trim threshold, while a drained engine's arrays are freed: a free that joins a heap's
# top then hands that top back, a thread's heap's too, which ``malloc_trim`` never does
DRAIN_TRIM_THRESHOLD = 128 << 10
_draining = 0  # drains handing memory back now: the last to finish sets the serving threshold again
_draining_lock = threading.Lock()


def reuse_freed_memory() -> None:
    """Have freed arrays' memory serve the next arrays, rather than go back to the OS at each free.

    MLX's CPU backend allocates every array with ``malloc``, and glibc serves blocks above its mmap
    threshold (128 KiB at first, raised as larger blocks are freed) from fresh mappings, which the
    kernel zeroes page by page as they are written and unmaps, across every core, when they are
    freed. A prefill's attention scores, a little larger each turn of a conversation, keep landing
    above it, and a CPU engine's prefills wait on page faults (``ops/bench/multiturn.py``). No
    effect where there is no glibc (macOS) or arrays are not on the C heap (Metal, CUDA).

    The threads share ``HEAP_ARENAS`` heaps, so that what each one keeps at its top (the trim
    threshold) is kept a couple of times, not once per thread. Called before the daemon starts
    its threads: a heap glibc made already stays."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
        _MALLOPT(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
        _MALLOPT(M_ARENA_MAX, HEAP_ARENAS)


def freeze_startup_objects() -> None:
    """Leave what the process made while starting out of every later garbage collection.

    The daemon's imports (mlx-lm, transformers, aiohttp and its own modules) make about 110,000
    objects that live as long as it does. A full collection examines every one of them, holding
    the GIL throughout, so each drain's collection (``return_freed_memory(cycles=True)``) and each
    of the collector's own full passes paused every stream for tens of milliseconds. Frozen, they
    are never examined; what is made afterwards (engines, requests) is collected as before. What
    is garbage now is collected first, so that none of it is frozen with them."""
    gc.collect()
    gc.freeze()


@contextmanager
def heap_tops_returned() -> Iterator[None]:
    """While inside, a heap's free top goes back to the OS as soon as a free joins it.

    ``malloc_trim`` hands back free pages inside every heap and the top of glibc's main heap, but
    not the top of a heap glibc made for threads, which keeps up to the trim threshold: what an
    engine's steps freed last stayed in a worker's RSS after it unloaded its Model. A drain frees
    that engine's arrays (the blocks below those tops) inside this, so the tops go with them.
    Serving threads' frees meanwhile hand their tops back too, which their next steps fault in
    again: a drain is seldom."""
    global _draining
    if _MALLOPT is None:
        yield
        return
    with _draining_lock:
        _draining += 1
        _MALLOPT(M_TRIM_THRESHOLD, DRAIN_TRIM_THRESHOLD)
    try:
        yield
    finally:
        with _draining_lock:
            _draining -= 1
            if not _draining:
                _MALLOPT(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)


def return_freed_memory(cycles: bool = False) -> None:
    """Give what MLX keeps for reuse, and the C heap's free pages, back to the OS; with ``cycles``,
    first collect the garbage that only refers to itself (a retired engine's objects refer to
    one another, so its arrays are freed by a collection, not when its last reference goes).

    The heap keeps what was freed for reuse (``reuse_freed_memory``), so what a retired
    engine freed would stay in the daemon's RSS for good. macOS's allocator returns memory
    by itself (and Metal buffers are not on the heap)."""
    if cycles:
        gc.collect()
    mx.clear_cache()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
