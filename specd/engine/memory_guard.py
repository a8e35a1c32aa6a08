"""Keeping an engine's work within MLX's own memory limit, whatever was requested.

A Model's request bounds what its engine holds (``resources.py``), and placement keeps a Node's
requests within what it offers. MLX's own memory limit (``mx.set_memory_limit``; ``specd daemon
--mlx-memory-limit``) can still be tighter than that, and memory can run short for reasons no
request counts: another Model given more than it asked (``resources.memory``), other work in the
process. On Metal, running out is not an error a server can catch: the command buffer fails in
Metal's completion handler and the process aborts (as ``mlx_lm.server`` does). So an engine reads
MLX's counters itself: a request starts only where the limit (or Metal's recommended working set,
where that is lower, as it is by default) leaves room for its KV and a step's working memory; it
waits while this engine's running requests will give memory back, or is refused (HTTP 503, naming
the numbers) where none will. A step that left MLX past the limit preempts the requests that joined
last (recomputed later, as for the KV budget); one always stays.

The counters are the process's (every Model's), so the Model that asks for more is the one that
waits or is refused; the others keep serving. Ranks of a tensor-parallel group read their own
counters, which differ, so their schedulers leave the limit to MLX
(``EngineConfig.watch_memory_limit``).
"""

from __future__ import annotations

import mlx.core as mx

from ..core.memory import gib, host_memory_bytes
from ..core.prefix import PrefixStore
from ..core.request import StepOutput
from ..core.sequence import Sequence
from .resources import ENGINE_OVERHEAD

OUT_OF_MEMORY = "out_of_memory"  # the error code of a request refused for MLX's memory limit


class MemoryGuard:
    """MLX's room under its memory limit, as an engine's admission and steps weigh it."""

    def __init__(self, working_bytes: int = ENGINE_OVERHEAD):
        self.working_bytes = working_bytes  # a step's activations beyond the KV, at most (a long prefill's)
        # MLX's default limit on a Mac is 1.5 times Metal's recommended working set, past what the
        # GPU can hold: the lower of the two is the limit (the host's memory, as Nodes count it)
        self.host = host_memory_bytes()

    def limit(self) -> int:
        return min(mx.get_memory_limit(), self.host)

    def headroom(self) -> int:
        """Bytes MLX may still allocate before the limit (negative past it)."""
        return self.limit() - mx.get_active_memory()

    def has_room(self, kv_bytes: int) -> bool:
        """Whether requests whose KV takes ``kv_bytes`` can start, with a step's working memory."""
        return kv_bytes + self.working_bytes <= self.headroom()

    def room(self, kv_bytes: int, gives_way: PrefixStore | None) -> bool:
        """``has_room``, after ``gives_way`` (a prefix cache, where no running row will give
        memory back) has dropped what it holds unleased until there is room, if it must."""
        if not self.has_room(kv_bytes) and gives_way is not None:
            gives_way.give_way(lambda: self.has_room(kv_bytes))
        return self.has_room(kv_bytes)

    def over(self) -> bool:
        return self.headroom() < 0

    def short(self) -> bool:
        """Whether MLX is short of memory: past nine tenths of the limit, or with room for less
        than two steps' working memory. The prefix cache gives way then (and records nothing
        new), before requests have to wait or be refused."""
        limit = self.limit()
        headroom = limit - mx.get_active_memory()
        return headroom < 0.1 * limit or headroom < 2 * self.working_bytes

    def refused(self, seq: Sequence, kv_bytes: int) -> StepOutput:
        """The end of a request whose KV takes ``kv_bytes`` and cannot start, with the numbers."""
        active, limit = mx.get_active_memory(), self.limit()
        message = (f"out of memory: the request needs {gib(kv_bytes)} of KV cache and {gib(self.working_bytes)} "
                   f"of working memory, and MLX holds {gib(active)} of its {gib(limit)} memory limit; "
                   "retry when other requests have finished")
        return seq.failed(message, OUT_OF_MEMORY)
