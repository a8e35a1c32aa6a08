"""Which replica serves a request: the one likely to hold its prefix, unless it is much busier.

As SGLang's router does, the head keeps an approximate prefix index per
replica: the prompt tokens of each request it routed, in ``CHUNK``-token
blocks, each block's hash chained to the one before, so two requests share a
leading run of hashes exactly as long as they share a leading run of tokens
(the head tokenizes every request itself, ``replica_set.py``). A request goes
to the replica holding the longest run of its blocks (the least busy among
equals), unless that replica is busier than the least busy one by more than a
margin (one request, or a quarter of the least busy one's, whichever is more);
then, and when no replica holds any of it, to the least busy one. So
conversations that open alike (one system prompt) still spread, and each stays
where its history is.

A Model whose prefix cache has a disk tier (``prefixCache.disk``) keeps what a
replica was sent on its Node's disk when the replica restarts or leaves the
Node: the index then remembers those blocks as on disk, and a request goes to
the replica holding the longest run in RAM, then on disk (a disk read is far
cheaper than a prefill, far dearer than a RAM hit).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

CHUNK = 64  # tokens per block
BLOCKS_PER_REPLICA = 65536  # blocks remembered per replica, least recently used dropped


def block_hashes(tokens: list[int]) -> list[bytes]:
    out, previous = [], b""
    for start in range(0, len(tokens) - CHUNK + 1, CHUNK):
        previous = hashlib.blake2b(previous + array("q", tokens[start:start + CHUNK]).tobytes(),
                                   digest_size=16).digest()
        out.append(previous)
    return out


POLICIES = ("prefix", "round-robin")  # round-robin: what a plain load balancer does (the benchmark's baseline)


class Router:
    def __init__(self, policy: str = "prefix") -> None:
        self.policy = policy
        self._blocks: dict[tuple[str, str], OrderedDict[bytes, None]] = {}  # in the replica's RAM
        self._disk: dict[tuple[str, str], OrderedDict[bytes, None]] = {}  # on its Node's disk
        self.on_disk: set[str] = set()  # the Models whose prefix caches have a disk tier
        self.in_flight: dict[tuple[str, str], int] = {}  # (model, node) -> requests routed and not finished
        self._turns: dict[str, int] = {}

    def pick(self, model: str, nodes: list[str], tokens: list[int]) -> str:
        """The Node, of ``nodes`` (in a stable order), whose replica serves a request of ``tokens``."""
        if self.policy == "round-robin":
            turn = self._turns[model] = self._turns.get(model, -1) + 1
            return nodes[turn % len(nodes)]
        hashes = block_hashes(tokens)
        load = {n: self.in_flight.get((model, n), 0) for n in nodes}
        least = min(load.values())
        matched = {n: (_matched(self._blocks.get((model, n), {}), hashes),
                       _matched(self._disk.get((model, n), {}), hashes)) for n in nodes}
        best = max(nodes, key=lambda n: (matched[n], -load[n]))
        if not any(matched[best]) or load[best] > least + max(1, least // 4):
            best = min(nodes, key=lambda n: (load[n], tuple(-m for m in matched[n])))
        _remember(self._blocks.setdefault((model, best), OrderedDict()), hashes)
        if model in self.on_disk:
            _remember(self._disk.setdefault((model, best), OrderedDict()), hashes)
        return best

    def keeps_on_disk(self, model: str, disk: bool) -> None:
        """Whether ``model``'s replicas keep their prefixes on disk (its spec's ``prefixCache.disk``)."""
        if disk:
            self.on_disk.add(model)
        else:
            self.on_disk.discard(model)
            for key in [k for k in self._disk if k[0] == model]:
                del self._disk[key]

    def forget(self, model: str, node: str) -> None:
        """A replica went away or restarted: what its RAM held is gone with it (its disk tier's stays)."""
        self._blocks.pop((model, node), None)

    def started(self, model: str, node: str) -> None:
        self.in_flight[(model, node)] = self.in_flight.get((model, node), 0) + 1

    def finished(self, model: str, node: str) -> None:
        self.in_flight[(model, node)] -= 1


def _matched(blocks: dict[bytes, None], hashes: list[bytes]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in blocks:
        n += 1
    return n


def _remember(blocks: OrderedDict[bytes, None], hashes: list[bytes]) -> None:
    for h in hashes:
        blocks[h] = None
        blocks.move_to_end(h)
    while len(blocks) > BLOCKS_PER_REPLICA:
        blocks.popitem(last=False)
