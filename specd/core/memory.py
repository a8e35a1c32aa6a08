"""The host's memory, as MLX can use it."""

from __future__ import annotations

import os

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
