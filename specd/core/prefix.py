"""Automatic prefix caching: a radix tree of cached model state over token prefixes.

Chat and agent traffic resends the same system prompt, tool list and
history with every request.  ``PrefixTree`` (SGLang's RadixAttention) maps
token prefixes to what a model's cache held after them, so a new request
prefills only what no earlier request already did:

- attention layers (full or sliding window) keep every position's keys and
  values on the edge that holds the position's token, so any matched prefix
  can be restored;
- recurrent layers (SSM, conv, gated delta net states) have no positions:
  a node keeps a *snapshot* of the state after its last token, taken where a
  prefill chunk, a prompt or a request ended, and a model with such layers
  resumes only at a node with a snapshot (SGLang's ``MambaRadixCache``).

A ``PrefixStore`` holds one tree per model that keeps a cache (the target,
its draft model, its EAGLE head) under one byte budget.  Nodes are
immutable copies, never written: a request's batch row reads its prefix's
columns in place from the nodes (``core.kv.RowKV.shared``) and writes only
what follows into buffers of its own, so many requests on one system prompt
hold it once, and speculation's rollback in a row never touches the tree.
A request holds a ``Lease`` on the node its prefix ends at (``cut`` first
makes a node end there, and ``tidy`` then merges the chain of unbranched
nodes above it, so the row reads few pieces, of nodes that stay), then on the deepest node
it extended, which keeps that node and its ancestors from eviction;
everything else is evicted least recently used first when the budget is
exceeded or memory runs short.  A conversation's last reply as generated goes
sooner, once its next turn (which resends the reply as text, rendered with
other tokens) is tidied: it would keep the turns from merging.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import BatchRowCache, RowPrefix, Snapshot, make_row_cache
from .columns import Columns, Pieces, pair_concat, pair_slice, side_bytes, side_copy
from .memory import host_memory_bytes

if TYPE_CHECKING:
    from .prefix_disk import DiskPrefixes

# What a piece a row reads in place is worth in tokens copied. Reading a cached prefix in place saves
# the memory of a copy (many rows on one system prompt hold it once), but each piece a row reads costs
# every decode step a few ops per attention layer: a row reads one piece per node of its prefix, copies
# the short nodes at its end (a conversation's turns), and a long node holds a copy of the few
# positions above it (a chat template's opening, a node of its own once two prompts differ after it).
PIECE_TOKENS = 256
# The most prompt tokens a superseded reply's branch may hold (``_superseded``): the few before a reply
# that the next turn renders otherwise (a chat template's assistant header), bounding what dropping a
# branch that was not superseded costs (that many tokens to prefill again, and its reply).
SUPERSEDED_PROMPT_TOKENS = 16


@dataclass(eq=False)
class Node:
    key: np.ndarray  # the edge's tokens
    parent: "Node | None"
    columns: Columns  # every attention layer's keys and values for the edge's positions (after ``lead`` others)
    snapshot: Snapshot | None = None  # the recurrent state after the edge's last token
    children: dict[int, "Node"] = field(default_factory=dict)
    locks: int = 0
    used: int = 0  # the store's clock when last matched or extended
    serial: int = 0  # creation order: ties in ``used`` evict alike on every tensor-parallel rank
    nbytes: int = 0
    lead: int = 0  # 0, or every position above the edge, whose columns ``columns`` holds a copy of first
    generated: int = 0  # the edge's last tokens that the request recording them generated (not its prompt's)


def _edge(node: Node) -> Columns:
    """The columns of ``node``'s edge only (views)."""
    return [pair_slice(pair, node.lead) for pair in node.columns] if node.lead else node.columns


def _joined(sources: list[Columns]) -> Columns:
    """Consecutive positions' columns as one piece per layer (not yet copied)."""
    return [pair_concat(list(layer)) for layer in zip(*sources)]


def _nbytes(columns: Columns, snapshot: Snapshot | None) -> int:
    n = sum(side_bytes(k) + side_bytes(v) for k, v in columns)
    return n + sum(a.nbytes for state in snapshot or [] for a in state if a is not None)


@dataclass(eq=False)
class Lease:
    """A request's hold on the deepest node its tokens reached: that node and
    its ancestors stay until the lease moves on or is released."""

    tree: "PrefixTree"
    node: "Node"
    depth: int

    def release(self) -> None:
        self.tree._lock(self.node, -1)


class PrefixTree:
    """One model's cached prefixes.  ``stateful``: the model has recurrent
    layers, so a prefix can resume only where a node holds a snapshot."""

    def __init__(self, store: "PrefixStore", stateful: bool):
        self.store = store
        self.stateful = stateful
        self.root = Node(np.zeros(0, dtype=np.int64), None, [])

    # -- reading ----------------------------------------------------------------

    def _path(self, tokens: Sequence[int], limit: int) -> list[tuple[Node, int]]:
        """The nodes ``tokens[:limit]`` runs through, each with how many of its
        edge's tokens match (the last may match part of its edge)."""
        path, node, pos = [], self.root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix(child.key, tokens[pos:limit])
            path.append((child, n))
            pos += n
            if n < len(child.key):
                break
            node = child
        return path

    def match(self, tokens: Sequence[int], limit: int) -> int:
        """How many leading tokens of ``tokens[:limit]`` can be restored."""
        tick = self.store.tick()
        best = pos = 0
        for node, n in self._path(tokens, limit):
            node.used = tick
            pos += n
            if not self.stateful:
                best = pos
            elif n == len(node.key) and node.snapshot is not None:
                best = pos
        return best

    def restore(self, tokens: Sequence[int], starts: list[int], end: int) -> tuple[list[Pieces], Snapshot | None]:
        """Attention layer i's columns for positions [starts[i], end) of
        ``tokens`` (a sliding window needs only its last ones), as views of
        the nodes' arrays, and, for recurrent layers, the snapshot at ``end``
        (which ``match`` found)."""
        path = self._path(tokens, end)
        if sum(n for _, n in path) != end:
            raise KeyError(f"a prefix of {end} tokens is not cached")
        snapshot = path[-1][0].snapshot if path and path[-1][1] == len(path[-1][0].key) else None
        columns = []
        for i, start in enumerate(starts):
            pieces, pos = [], 0
            for node, n in path:
                first = pos - node.lead  # the position of the node's first column
                if node.lead:
                    pieces = []  # the node holds the positions above it too
                lo, hi = max(start - first, 0), pos + n - first
                if hi > lo:
                    pieces.append(pair_slice(node.columns[i], lo, hi))
                pos += n
            columns.append(pieces)
        return columns, snapshot

    def ends(self, tokens: Sequence[int], length: int) -> list[int]:
        """Where the pieces end that a row restoring the cached ``tokens[:length]`` reads
        (one per node, from the last that holds the positions above it), the last at ``length``."""
        out, pos = [], 0
        for node, n in self._path(tokens, length):
            pos += n
            out = [pos] if node.lead else out + [pos]
        return out

    def cut(self, tokens: Sequence[int], length: int) -> None:
        """Make the cached prefix ``tokens[:length]`` end at a node: a prefix that ends inside an
        edge splits it (a row restoring it then reads a node that a later split would not replace
        with copies, and a lease holds exactly the prefix)."""
        path = self._path(tokens, length)
        if path and path[-1][1] < len(path[-1][0].key):
            self._split(*path[-1])

    def tidy(self, tokens: Sequence[int], length: int) -> None:
        """Make the chain of nodes that nothing else branches from or holds, which the cached
        prefix ``tokens[:length]`` (cut to end at a node) ends with, one node (the chunks of one
        prefill, a conversation's turns), so a row reads a long prefix in a few pieces; then a
        long node below a few positions holds them too (``_lead``). What is superseded beside the
        chain goes (``_merge_chain``): a prefix that another row starts from goes too unless that
        row holds it already."""
        path = self._path(tokens, length)
        if not path:
            return
        self._merge_chain(path[-1][0])
        self._lead(tokens, length)

    def _lead(self, tokens: Sequence[int], length: int) -> None:
        """Copy the columns above the first node of the path that has at least one but fewer than
        ``PIECE_TOKENS`` positions above it, and ``PIECE_TOKENS`` of its own, in front of its own:
        requests whose prompts differ after their first few tokens (a chat template's opening, then
        different system prompts) make those tokens a node, one more piece for every row to read."""
        path, pos = self._path(tokens, length), 0
        for node, n in path:
            if 0 < pos < PIECE_TOKENS <= len(node.key) and not node.lead:
                above, up = [], node.parent
                while up is not self.root:
                    above.insert(0, up)
                    if up.lead:
                        break
                    up = up.parent
                columns = _joined([above[0].columns] + [_edge(a) for a in above[1:]] + [node.columns])
                if self._make_room(path[-1][0], _nbytes(columns, None) - _nbytes(node.columns, None)):
                    node.columns, node.lead = _owned(columns), pos
                    self.store.account(node)
                return
            pos += n

    def _merge_chain(self, end: Node) -> None:
        """Merge ``end`` with the ancestors that have one child, no snapshot and
        no lease of their own (their locks are all their child's), into ``end``:
        leases on ``end`` stay valid, since its last position is the same.
        What is superseded beside the chain goes first (``_superseded``)."""
        chain = [end]
        while True:
            up = chain[0].parent
            for sibling in [c for c in up.children.values() if c is not chain[0] and _superseded(c)]:
                self._drop(sibling)
            if up is self.root or len(up.children) > 1 or up.snapshot is not None or up.locks != chain[0].locks:
                break
            chain.insert(0, up)
        if len(chain) == 1:
            return
        first = chain[0]
        end.columns = _owned(_joined([first.columns] + [_edge(node) for node in chain[1:]]))
        end.lead = first.lead
        end.key = np.concatenate([node.key for node in chain])
        end.generated = _trailing_generated(chain)
        end.parent = first.parent
        end.parent.children[int(end.key[0])] = end
        end.used = max(node.used for node in chain)
        for node in chain[:-1]:
            self.store.bytes -= node.nbytes
            node.children = {}
        self.store.nodes -= len(chain) - 1
        self.store.account(end)

    def _drop(self, node: Node) -> None:
        """Drop an unleased node and everything below it."""
        for child in list(node.children.values()):
            self._drop(child)
        self.store.remove(node)

    # -- leases -------------------------------------------------------------------

    def lease(self, tokens: Sequence[int], length: int) -> Lease:
        """Hold the deepest node whose edge ends at or before ``length``."""
        node, depth = self.root, 0
        for child, n in self._path(tokens, length):
            if n < len(child.key):
                break
            node, depth = child, depth + n
        self._lock(node, 1)
        return Lease(self, node, depth)

    def _lock(self, node: Node, delta: int) -> None:
        while node is not None:
            node.locks += delta
            node = node.parent

    # -- writing ------------------------------------------------------------------

    def extend(self, lease: Lease, tokens: Sequence[int], end: int,
               columns: Callable[[int, int], Columns | None], snapshot: Snapshot | None = None,
               prompt: int | None = None) -> None:
        """Record ``tokens[:end]``, which extend the lease's path: ``columns(a, b)``
        gives positions [a, b) for the part the tree lacks (None: not held any
        more), ``snapshot`` the recurrent state at ``end``; the tokens after the
        first ``prompt`` (by default none) are the request's output.  What does
        not fit the budget, even after evicting everything unleased, is not
        recorded.  The lease moves to the deepest node recorded."""
        if end <= lease.depth or (self.stateful and snapshot is None):
            return
        snapshot = snapshot if self.stateful else None
        node, pos = lease.node, lease.depth
        while pos < end:
            child = node.children.get(tokens[pos])
            if child is None:
                cols = columns(pos, end)
                if cols is None or not self._make_room(node, _nbytes(cols, snapshot)):
                    break
                # evaluated before the tree holds it: a failing forward leaves no node behind
                child = Node(np.asarray(tokens[pos:end], dtype=np.int64), node, _owned(cols),
                             _own_snapshot(snapshot), serial=self.store.tick(),
                             generated=0 if prompt is None else max(0, end - max(prompt, pos)))
                node.children[int(tokens[pos])] = child
                self.store.nodes += 1
                self.store.account(child)
                node, pos = child, end
                break
            n = common_prefix(child.key, tokens[pos:end])
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        if (pos == end and snapshot is not None and node.snapshot is None
                and self._make_room(node, _nbytes([], snapshot))):
            node.snapshot = _own_snapshot(snapshot)
            self.store.account(node)
        tick = self.store.tick()
        walk = node
        while walk is not None:
            walk.used = tick
            walk = walk.parent
        self._lock(node, 1)
        lease.release()
        lease.node, lease.depth = node, pos

    def _make_room(self, keep: Node, need: int) -> bool:
        """``store.make_room``, never evicting ``keep`` (the node being extended) or its ancestors."""
        self._lock(keep, 1)
        try:
            return self.store.make_room(need)
        finally:
            self._lock(keep, -1)

    def _split(self, node: Node, n: int) -> Node:
        """Cut ``node``'s edge after ``n`` tokens; returns the new upper node
        (the lower part keeps the snapshot, the children and the locks)."""
        lead = node.lead
        upper = Node(node.key[:n], node.parent, _owned([pair_slice(pair, 0, lead + n) for pair in node.columns]),
                     locks=node.locks, used=node.used, serial=self.store.tick(), lead=lead,
                     generated=max(0, node.generated - (len(node.key) - n)))
        node.parent.children[int(node.key[0])] = upper
        node.key = node.key[n:]
        node.generated = min(node.generated, len(node.key))
        node.columns = _owned([pair_slice(pair, lead + n) for pair in node.columns])
        node.lead = 0
        node.parent = upper
        upper.children[int(node.key[0])] = node
        self.store.nodes += 1
        self.store.account(node)
        self.store.account(upper)
        return upper

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _owned(columns: Columns) -> Columns:
    """Evaluated copies that share no buffer with a batch cache or another node."""
    out = [(side_copy(k), side_copy(v)) for k, v in columns]
    mx.eval(out)
    return out


def _superseded(node: Node) -> bool:
    """Whether the nodes from ``node`` down hold only what no prompt will ask for again: no request
    holds them, each leaf ends in tokens a request generated, and at most ``SUPERSEDED_PROMPT_TOKENS``
    of their tokens came from a prompt. That is a conversation's last reply, which its next turn
    resends as text that a chat template or the tokenizer renders with other tokens, with the few
    prompt tokens before it that the next turn renders otherwise too. Kept, they would keep the
    conversation's turns apart: one more piece per turn for its rows to read."""
    prompted, stack = 0, [node]
    while stack:
        n = stack.pop()
        if n.locks or (not n.children and not n.generated):
            return False
        prompted += len(n.key) - n.generated
        if prompted > SUPERSEDED_PROMPT_TOKENS:  # another conversation: no need to walk the rest of it
            return False
        stack.extend(n.children.values())
    return True


def _trailing_generated(chain: list[Node]) -> int:
    """How many of a chain's last tokens, its edges joined, were generated (``Node.generated``)."""
    total = 0
    for node in reversed(chain):
        total += node.generated
        if node.generated < len(node.key):
            break
    return total


def _own_snapshot(snapshot: Snapshot | None) -> Snapshot | None:
    if snapshot is None:
        return None
    out = [[None if a is None else mx.contiguous(a) for a in state] for state in snapshot]
    mx.eval([a for state in out for a in state if a is not None])
    return out


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


def default_max_bytes() -> int:
    """A tenth of the host's memory (what the prefix cache may hold unless the Model says otherwise)."""
    return host_memory_bytes() // 10


class PrefixStore:
    """A Model's prefix trees (target, draft model, EAGLE head) under one budget."""

    def __init__(self, max_bytes: int, pressure: Callable[[], bool] | None = None):
        self.max_bytes = max_bytes
        self.pressure = pressure  # whether MLX is short of memory (``engine/memory_guard.py``): the cache gives way
        self.trees: dict[str, PrefixTree] = {}
        self.bytes = 0
        self.nodes = 0
        self.queried = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, restored from the cache (prefix_cache_hits)
        self.evicted = 0
        self._clock = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def tree(self, name: str, stateful: bool) -> PrefixTree:
        tree = self.trees.get(name)
        if tree is None or tree.stateful != stateful:
            self.drop(name)
            tree = self.trees[name] = PrefixTree(self, stateful)
        return tree

    def drop(self, name: str) -> None:
        """Forget a tree (its model was detached).  Unlinking every node from
        its children breaks the parent/child cycles, so the tree's arrays are
        freed now rather than at the next full garbage collection."""
        tree = self.trees.pop(name, None)
        if tree is not None:
            nodes = tree.nodes()
            self.bytes -= sum(node.nbytes for node in nodes)
            self.nodes -= len(nodes)
            for node in [tree.root, *nodes]:
                node.children = {}

    def clear(self) -> None:
        """Forget every tree (the engine stopped)."""
        for name in list(self.trees):
            self.drop(name)

    def tick(self) -> int:
        return next(self._clock)

    def account(self, node: Node) -> None:
        self.bytes -= node.nbytes
        node.nbytes = _nbytes(node.columns, node.snapshot)
        self.bytes += node.nbytes

    def record(self, queried: int, hit: int) -> None:
        self.queried += queried
        self.hits += hit

    def make_room(self, need: int) -> bool:
        """Evict until ``need`` more bytes fit; False if they cannot, or
        while MLX is short of memory (the cache gives way to requests)."""
        self.evict(need)
        return self.bytes + need <= self.max_bytes and not (self.pressure and self.pressure())

    def evict(self, need: int = 0) -> None:
        """Drop unleased leaves, least recently used first, until ``need``
        more bytes fit the budget and MLX is not short of memory."""
        self.give_way(lambda: not (self.bytes + need > self.max_bytes
                                   or bool(self.pressure and self.bytes and self.pressure())))

    def give_way(self, enough: Callable[[], bool]) -> None:
        """Drop unleased leaves, least recently used first, until ``enough()`` (or a request's
        room under MLX's memory limit: ``engine/memory_guard.py``)."""
        if enough():
            return
        heap = [(node.used, node.serial, node) for tree in self.trees.values() for node in tree.nodes()
                if not node.children and not node.locks]
        heapq.heapify(heap)
        while heap and not enough():
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.remove(node)
            if parent.parent is not None and not parent.children and not parent.locks:
                heapq.heappush(heap, (parent.used, parent.serial, parent))

    def remove(self, leaf: Node) -> None:
        """Drop an unleased leaf and what it holds."""
        del leaf.parent.children[int(leaf.key[0])]
        self.bytes -= leaf.nbytes
        self.nodes -= 1
        self.evicted += 1

    def status(self) -> dict:
        """What ``describe model`` shows (counters only: read from any thread)."""
        return {"maxBytes": self.max_bytes, "bytes": self.bytes, "nodes": self.nodes,
                "queriedTokens": self.queried, "hitTokens": self.hits,
                "hitRate": round(self.hits / self.queried, 4) if self.queried else None,
                "evictedNodes": self.evicted}


class RowPrefixes:
    """One model's rows and its tree: where new rows start, and recording
    what rows hold as they prefill and when they leave (keyed by sequence).

    ``windows`` lists each attention layer's sliding window (None: full), in
    the cache's column order: a windowed layer restores only the positions
    a new token can still see.  Without a tree (caching off, or a cache
    that cannot start from a prefix) every row starts empty."""

    SLACK = 32  # cached tokens a row may recompute to share a group's prefill width

    def __init__(self, tree: PrefixTree | None, windows: list[int | None]):
        self.tree = tree
        self.windows = windows
        self.leases: dict[object, Lease] = {}
        self.disk: DiskPrefixes | None = None  # the tree's disk tier, if the Model has one
    def match(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Cached tokens ``tokens`` could start from (by default at least one is left to run)."""
        if self.tree is None:
            return 0
        return self.tree.match(tokens, len(tokens) - 1 if limit is None else limit)

    def plan(self, contexts: list[Sequence[int]], limits: list[int] | None = None) -> tuple[int, list[int]]:
        """Start left-padded rows together: the columns every row runs
        (``width``) and how many cached tokens each starts from (at most its
        limit).  A row whose cache is shorter than the others' makes them
        all run more; a recurrent model must also start each row at a snapshot."""
        lengths = [len(c) for c in contexts]
        limits = limits or [n - 1 for n in lengths]
        width = max(n - self.match(c, lim) for n, c, lim in zip(lengths, contexts, limits))
        while self.tree is not None and self.tree.stateful:
            need = width
            for n, c in zip(lengths, contexts):
                if n > width:
                    need = max(need, n - self.tree.match(c, n - width))
            if need == width:
                break
            width = need
        return width, [max(0, n - width) for n in lengths]

    def admissible(self, contexts: list[Sequence[int]], matches: list[int], limits: list[int],
                   chunk_tokens: int) -> bool:
        """Whether rows are worth starting together: at most one starts from
        a cached prefix (its prefill attends to its whole context, so a
        second one would only delay the first one's first token), unless the
        whole group's prefill fits one chunk of ``chunk_tokens`` (every row's
        first token then comes in the same step, which rows started one
        group after another would spread over as many steps), none gives
        up more of its cached prefix than ``SLACK`` or what it runs anyway,
        and no two would compute the same uncached prefix (the second waits
        and then finds it cached)."""
        if self.tree is None or len(contexts) == 1:
            return True
        width, starts = self.plan(contexts, limits)
        if sum(1 for m in matches if m) > 1 and width * len(contexts) > chunk_tokens:
            return False
        for m, s, c in zip(matches, starts, contexts):
            if m - s > max(self.SLACK, len(c) - m):
                return False
        new, m_new = contexts[-1], matches[-1]
        return all(common_prefix(np.asarray(c, dtype=np.int64), new) - max(m, m_new) < self.SLACK
                   for c, m in zip(contexts[:-1], matches[:-1]))

    def in_place(self, tokens: Sequence[int], length: int) -> int:
        """How many leading positions of the cached prefix ``tokens[:length]`` a row starting from it
        reads in place: up to the end of the piece that leaves the least cost, each piece read
        counting as ``PIECE_TOKENS`` tokens and each position after it as one token copied."""
        if self.tree is None or not length:
            return 0
        best, least = 0, length
        for pieces, end in enumerate(self.tree.ends(tokens, length), 1):
            cost = pieces * PIECE_TOKENS + length - end
            if cost <= least:  # a tie reads in place: less memory
                best, least = end, cost
        return best

    def shared(self, tokens: Sequence[int], length: int) -> int:
        """Tokens of the cached prefix ``tokens[:length]`` that a row starting from it reads in
        place in every attention layer (a sliding window's layer restores only what it still sees)."""
        if not self.windows:
            return 0
        in_place = self.in_place(tokens, length)
        return min(in_place if w is None else max(0, in_place - max(0, length - (w - 1))) for w in self.windows)

    def start(self, rows: list[tuple[object, Sequence[int], int]]) -> list[RowPrefix | None]:
        """The prefixes rows starting together start from: for each (key, tokens, length), the
        cached ``tokens[:length]`` (None: from nothing); each row holds a lease from now on. Every
        row's prefix is cut to end at a node and leased before any is tidied, as tidying drops
        superseded branches, which a short prompt's cached prefix looks like until a row holds it."""
        if self.tree is None:
            return [None] * len(rows)
        for _, tokens, length in rows:
            self.tree.cut(tokens, length)
        for key, tokens, length in rows:
            self.leases[key] = self.tree.lease(tokens, length)
        for _, tokens, length in rows:
            self.tree.tidy(tokens, length)
        return [self._restore(tokens, length) for _, tokens, length in rows]

    def _restore(self, tokens: Sequence[int], length: int) -> RowPrefix | None:
        if not length:
            return None
        starts = [0 if w is None else max(0, length - (w - 1)) for w in self.windows]
        columns, snapshot = self.tree.restore(tokens, starts, length)
        return RowPrefix(length, columns, snapshot, self.in_place(tokens, length))

    def record(self, key: object, known: Sequence[int], held: int, cache: BatchRowCache, b: int, *,
               prompt: int) -> None:
        """Row b of ``cache`` holds ``held`` positions, whose tokens begin
        with ``known`` (its request's prompt's first ``prompt``, then what it
        generated): record what the tree lacks.  A row that ran past what is
        known (a request that ended inside a round) has recurrent state that
        no known prefix names, so it records columns only."""
        lease = self.leases.get(key)
        end = min(held, len(known))
        if lease is None or end <= lease.depth:
            return
        state = cache.row_snapshot(b) if self.tree.stateful and end == held else None
        before = lease.depth
        self.tree.extend(lease, known, end, lambda lo, hi: cache.row_columns(b, lo, hi), state, prompt)
        if self.disk is not None and lease.depth > before:
            self.disk.recorded(known, before, lease.depth, lease.node.snapshot if lease.depth == end else None)

    def release(self, key: object) -> None:
        if self.disk is not None:
            self.disk.forget(key)
        lease = self.leases.pop(key, None)
        if lease is not None:
            lease.release()
            self.tree.store.evict()  # what only this lease kept may be due


def model_prefixes(model: nn.Module, store: PrefixStore, name: str) -> RowPrefixes:
    """A model's rows in the prefix cache, its tree called ``name`` (none
    when the budget is 0, or for a row-by-row cache, which cannot start
    from a prefix)."""
    layout = make_row_cache(model, [0])
    if not store.enabled or not isinstance(layout, BatchRowCache):
        return RowPrefixes(None, [])
    return RowPrefixes(store.tree(name, stateful=bool(layout.recurrent)), layout.windows)
