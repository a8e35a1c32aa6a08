"""Which replica serves a request: the one likely to hold its prefix, unless it is much busier.

As SGLang's router does, the head keeps an approximate prefix index per
replica: the text of each request it routed (its messages, prompt or input,
canonically serialized) in ``CHUNK``-character blocks, each block's hash
chained to the one before, so two requests share a leading run of hashes
exactly as long as they share a leading run of text. A request goes to the
replica holding the longest run of its blocks (the least busy among equals),
unless that replica is busier than the least busy one by more than a margin
(one request, or a quarter of the least busy one's, whichever is more); then,
and when no replica holds any of it, to the least busy one. So conversations
that open alike (one system prompt) still spread, and each stays where its
history is.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

CHUNK = 256  # characters per block
BLOCKS_PER_REPLICA = 65536  # blocks remembered per replica, least recently used dropped
PROMPT_FIELDS = ("system", "instructions", "messages", "prompt", "input")


@dataclass(frozen=True)
class Replica:
    node: str
    address: str | None  # None: this daemon's own engine


def prompt_text(body: dict[str, Any]) -> str:
    """What of a request's body a replica's prefix cache would hold, as one string."""
    return json.dumps([body.get(k) for k in PROMPT_FIELDS], ensure_ascii=False, sort_keys=True)[:-1]


def block_hashes(text: str) -> list[bytes]:
    out, previous = [], b""
    for start in range(0, len(text) - CHUNK + 1, CHUNK):
        previous = hashlib.blake2b(previous + text[start:start + CHUNK].encode("utf-8", "surrogatepass"),
                                   digest_size=16).digest()
        out.append(previous)
    return out


POLICIES = ("prefix", "round-robin")  # round-robin: what a plain load balancer does (the benchmark's baseline)


class Router:
    def __init__(self, policy: str = "prefix") -> None:
        self.policy = policy
        self._blocks: dict[tuple[str, str], OrderedDict[bytes, None]] = {}
        self.in_flight: dict[tuple[str, str], int] = {}  # (model, node) -> requests routed and not finished
        self._turns: dict[str, int] = {}

    def pick(self, model: str, replicas: list[Replica], body: dict[str, Any]) -> Replica:
        if self.policy == "round-robin":
            turn = self._turns[model] = self._turns.get(model, -1) + 1
            return sorted(replicas, key=lambda r: r.node)[turn % len(replicas)]
        hashes = block_hashes(prompt_text(body))
        load = {r: self.in_flight.get((model, r.node), 0) for r in replicas}
        least = min(load.values())
        matched = {r: self._matched(model, r.node, hashes) for r in replicas}
        best = max(replicas, key=lambda r: (matched[r], -load[r]))
        if not matched[best] or load[best] > least + max(1, least // 4):
            best = min(replicas, key=lambda r: (load[r], -matched[r]))
        self._remember(model, best.node, hashes)
        return best

    def _matched(self, model: str, node: str, hashes: list[bytes]) -> int:
        blocks = self._blocks.get((model, node), {})
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n

    def _remember(self, model: str, node: str, hashes: list[bytes]) -> None:
        blocks = self._blocks.setdefault((model, node), OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > BLOCKS_PER_REPLICA:
            blocks.popitem(last=False)

    def forget(self, model: str, node: str) -> None:
        """A replica went away: what it held is gone with it."""
        self._blocks.pop((model, node), None)

    def started(self, model: str, node: str) -> None:
        self.in_flight[(model, node)] = self.in_flight.get((model, node), 0) + 1

    def finished(self, model: str, node: str) -> None:
        self.in_flight[(model, node)] -= 1
