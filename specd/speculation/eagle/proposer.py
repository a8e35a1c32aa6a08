"""EAGLE proposals: the head drafts a chain or an EAGLE-2 dynamic tree per row.

The head reads the target's own features, so the target's forwards feed it:
every prefill chunk and verify step hands over the features of the columns
the target kept (``observe``), queued per sequence until the head next runs.
The head's batched KV cache therefore only ever holds accepted context,
computed from the target's true features: rollback is exact by construction
(what a step drafted is never written to it, and a row catching up feeds its
queued pairs right-padded, rolling the padding back like the draft proposer).

Drafting (``propose``): feed every row's queued pairs; the last output
predicts the root's children.  Then, depth by depth, the ``top_k`` newest
candidates with the highest cumulative log-probability are expanded by one
``draft_step`` (each attends to the context and its ancestors), each giving
its ``top_k`` children; finally all candidates are reranked by cumulative
log-probability and the best ``budget`` kept (a child never outranks its
parent, so the kept nodes form a tree).  ``top_k = 1`` is chain drafting.

A sequence whose target prefix came from the prefix cache has no features
for it: the head starts such a row from its own cached entries (entry i,
the head's state for feature i and token i+1, is keyed by the token pair),
and the target restores no more than the head holds (``cached``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...core.cache import BatchRowCache, RowPrefix
from ...core.kv import RowKV
from ...core.layout import clock
from ...core.prefix import RowPrefixes
from ...core.sequence import Sequence
from ...core.request import Method, SpeculationConfig
from ..proposer import Drafts, FollowedRows, Outcome, Round
from ..tree import DraftTree
from .capture import FeatureCapture
from ...core.model_parts import target_parts
from .head import EagleHead
from ..mtp.head import MTPHead


class EagleProposer:
    method = Method.EAGLE

    def __init__(self, head: EagleHead | MTPHead, target: nn.Module, prefixes: RowPrefixes):
        self.head = head
        self.prefixes = prefixes  # the head's cached entries, keyed by token pairs
        self.origin: dict[Sequence, RowPrefix | None] = {}  # where a row not in the head's cache yet starts
        self.embed, self.lm_head = target_parts(target)
        self.capture = FeatureCapture(target, head.feature_layers)
        self.row_bytes = (head.row_bytes, 0)
        self.rows: FollowedRows[int] = FollowedRows()  # per row: positions in the head's cache
        self.queued: dict[Sequence, list[mx.array]] = {}  # fused features not fed to the head yet
        self.caught_up = False
        self.backlog_seconds = 0.0

    def detach(self) -> None:
        """Unhook the target (the pairing changed)."""
        self.capture.remove()

    # -- the target's forwards feed the head ----------------------------------

    def take_features(self) -> mx.array:
        """The fused features of the target forward built last (B, N, H)."""
        return self.head.fuse(self.capture.take())

    def _observe(self, seqs: list[Sequence], columns: list[list[int]], features: mx.array | None = None) -> None:
        """A target forward kept ``columns[b]`` of row b (``features``: its, else the last forward's)."""
        features = self.take_features() if features is None else features
        for b, (seq, cols) in enumerate(zip(seqs, columns)):
            if cols and seq in self.queued:
                self.queued[seq].append(features[b, mx.array(cols)])

    def prefilled(self, seqs: list[Sequence], specs: list[SpeculationConfig], columns: list[list[int]],
                  started: bool) -> None:
        """Keep the features of EAGLE sequences from their first prefill chunk
        on (only those the head saw whole can draft)."""
        if started:
            mine = [s for s, spec in zip(seqs, specs) if spec.method == self.method]
            starts = self.prefixes.start([(s, self.entry_keys(s.prefill_tokens), s.restored_tokens) for s in mine])
            for s, origin in zip(mine, starts):
                self.origin[s] = origin
                self.queued.setdefault(s, [])
        self._observe(seqs, columns)

    def cached(self, prompt: list[int]) -> int:
        """How many leading positions of ``prompt`` the head holds cached entries for."""
        return self.prefixes.match(self.entry_keys(prompt), len(prompt) - 1)

    def commit(self, round_: Round, outcome: Outcome) -> None:
        self._observe(round_.seqs, outcome.kept_columns, outcome.features)

    def settle(self) -> None:
        """The head's cache only ever receives accepted context: nothing to settle."""

    def can_draft(self, seq: Sequence) -> bool:
        """Whether the head has seen this sequence's every feature, and has some (a one-token
        prompt has none until its first decode step)."""
        return seq in self.rows or bool(self.queued.get(seq))

    def release(self, seqs: list[Sequence]) -> None:
        """Feed leaving rows what is queued for them and record the head's
        entries, so a later request that starts from their prefix can draft."""
        if self.prefixes.tree is not None:
            self._flush([s for s in seqs if self.queued.get(s)])
            for s in seqs:
                if s in self.rows:
                    self.prefixes.record(s, self.entry_keys(s.context_keys), self.rows.state[s],
                                         self.rows.cache, self.rows.seqs.index(s),
                                         prompt=len(self.entry_keys(s.prompt_keys)))
        for s in seqs:
            self.prefixes.release(s)
            self.queued.pop(s, None)
            self.origin.pop(s, None)
        self.rows.release(seqs)

    def _flush(self, seqs: list[Sequence]) -> None:
        """Feed ``seqs`` (and only them) everything queued for them."""
        rows = self.rows
        held = [s for s in seqs if s in rows]
        if held:
            empty = (mx.zeros((0, self.head.hidden_size)), [])
            pairs = [self._pairs(s, rows.state[s]) if s in held else empty for s in rows.seqs]
            self._feed(pairs, rows.cache, left=False)
            for s, (f, _) in zip(rows.seqs, pairs):
                rows.state[s] += f.shape[0]
        new = [s for s in seqs if s not in rows]
        if new:
            self._start(new)

    # -- drafting ---------------------------------------------------------------

    def _pairs(self, seq: Sequence, start: int) -> tuple[mx.array, list[int]]:
        """A sequence's queued (feature, next token) pairs, from cache position
        ``start`` (a request that ended inside a round has features past its
        last kept token: they pair with nothing)."""
        features = mx.concatenate(self.queued[seq], axis=0)
        self.queued[seq] = []
        context = seq.prompt + seq.tokens
        tokens = context[start + 1: start + 1 + features.shape[0]]
        return features[: len(tokens)], tokens

    @staticmethod
    def entry_keys(tokens: list[int]) -> list[int]:
        """What the head's cached entries are keyed by, for a context of ``tokens``."""
        return pair_keys(tokens)

    def _feed(self, pairs: list[tuple[mx.array, list[int]]], cache: BatchRowCache, left: bool) -> mx.array | None:
        """Feed each row its pairs, padded on the left (a fresh cache) or on the
        right (rolled back after); returns each row's last output (B, H)."""
        width = max(len(t) for _, t in pairs)
        hidden, tokens = [], []
        for f, t in pairs:
            pad = width - len(t)
            hidden.append(mx.pad(f, [(pad, 0) if left else (0, pad), (0, 0)]))
            tokens.append([0] * pad + t if left else t + [0] * pad)
        out = self.head(mx.stack(hidden), self.embed(mx.array(tokens)), cache.layers[0])
        if left:
            return out[:, -1]
        cache.rollback([width - len(t) for _, t in pairs])
        return out[mx.arange(len(pairs)), mx.array([len(t) - 1 for _, t in pairs])]

    def _start(self, new: list[Sequence]) -> dict[Sequence, mx.array]:
        """Give sequences the head has not seen yet their rows, each from its
        cached entries on, fed all that is queued; returns their last outputs."""
        origins = [self.origin[s] for s in new]
        starts = [0 if o is None else o.length for o in origins]
        pairs = [self._pairs(s, n) for s, n in zip(new, starts)]
        for s in new:
            del self.origin[s]
        width = max(len(t) for _, t in pairs)
        cache = BatchRowCache([RowKV([width - len(t) for _, t in pairs]) for _ in range(self.head.cache_layers)])
        if any(origins):
            cache.restore(origins)
        last = self._feed(pairs, cache, left=True)
        for b, (s, n, (f, _)) in enumerate(zip(new, starts, pairs)):
            self.prefixes.record(s, self.entry_keys(s.context_keys), n + f.shape[0], cache, b,
                                 prompt=len(self.entry_keys(s.prompt_keys)))
        self.rows.add([(s, n + f.shape[0]) for s, n, (f, _) in zip(new, starts, pairs)], cache)
        return {} if last is None else {s: last[i] for i, s in enumerate(new)}

    def _catch_up(self, seqs: list[Sequence]) -> mx.array | None:
        """Make the head's rows exactly ``seqs`` and feed everything queued; (B, H) root outputs
        (None from a drafter whose feeding outputs nothing)."""
        new = self.rows.follow(seqs)
        rows = self.rows
        self.caught_up = bool(new)  # a prefill's features: a one-off cost in the step
        # a round feeds a row one step's features, two after a plain step in between; more is a
        # backlog that plain steps left (a controller's try after a run of them): fed and timed
        # apart, so that neither the draft cost nor the step's stands for it
        backlog = any(len(self.queued[s]) > 2 for s in rows.seqs)
        started = clock()
        outputs = {}
        if len(rows):
            pairs = []
            for s in rows.seqs:
                pairs.append(self._pairs(s, rows.state[s]))
                rows.state[s] += pairs[-1][0].shape[0]
            last = self._feed(pairs, rows.cache, left=False)
            if last is not None:
                outputs.update({s: last[i] for i, s in enumerate(rows.seqs)})
        if backlog:
            mx.eval(rows.cache.state, list(outputs.values()))
        self.backlog_seconds = clock() - started if backlog else 0.0
        if new:
            outputs.update(self._start(new))
        rows.order(seqs)
        return mx.stack([outputs[s] for s in seqs]) if outputs else None

    def propose(self, round_: Round) -> Drafts:
        """Every EAGLE row the head knows catches up; drafting rows get a
        chain, or a branching tree when their tree shape asks for one."""
        ks = round_.ks
        members = [i for i in round_.rows(self.method) if ks[i] or round_.seqs[i] in self.rows]
        specs = [round_.specs[i] for i in members]
        top_k = max(spec.tree_top_k for spec in specs)
        depth = max(ks[i] for i in members)
        budget = max(spec.tree_tokens for spec in specs) if top_k > 1 else depth
        trees = self._expand([round_.seqs[i] for i in members], [ks[i] > 0 for i in members], depth, top_k, budget,
                             [spec.tree_top_k == 1 for spec in specs])
        out = Drafts(shape=(len(members), depth))  # the head's steps cost like a draft model's
        for i, tree in zip(members, trees):
            if tree is None:
                continue
            tree = tree.pruned(ks[i])
            if all(p == j - 1 for j, p in enumerate(tree.parents)):
                out.chains[i] = tree.tokens
            else:
                out.trees[i] = tree
        return out

    def _expand(self, seqs: list[Sequence], drafting: list[bool], depth: int, top_k: int,
                budget: int, chains: list[bool]) -> list[DraftTree | None]:
        """Trees (up to ``depth`` deep, ``budget`` nodes) for the ``drafting``
        rows of ``seqs`` (every EAGLE row of the batch, so the others catch up
        too); a row in ``chains`` gets the tree's most likely path.

        The expansion runs on the device without a host round trip per depth:
        candidates are recorded as (token, parent candidate, score) arrays and
        read back once, at the end."""
        outputs = self._catch_up(seqs)[:, None]  # (B, 1, H): the root's
        B = len(seqs)
        frontier_ids = mx.full((B, 1), -1, dtype=mx.int32)  # candidate ids (-1: the root)
        frontier_scores = mx.zeros((B, 1))
        tokens, parents, scores = [], [], []
        ancestry = mx.zeros((B, 0, 0), dtype=mx.bool_)  # among drafted slots: ancestor or self
        nodes = None
        count = 0
        for level in range(1, depth + 1):
            logp = self._logprobs(outputs)  # (B, F, V)
            F = logp.shape[1]
            top = mx.argpartition(-logp, kth=top_k - 1, axis=-1)[..., :top_k]  # (B, F, top_k)
            child_scores = frontier_scores[..., None] + mx.take_along_axis(logp, top, axis=-1)
            tokens.append(top.reshape(B, F * top_k))
            parents.append(mx.repeat(frontier_ids, top_k, axis=1))
            scores.append(child_scores.reshape(B, F * top_k))
            if level == depth:
                break
            # the next frontier: the top_k children by cumulative log-probability, drafted as one step
            pick = mx.argsort(-scores[-1], axis=-1)[:, :top_k]  # (B, top_k) among this level's children
            from_slot = pick // top_k  # which frontier node each comes from
            frontier_ids = (pick + count).astype(mx.int32)
            frontier_scores = mx.take_along_axis(scores[-1], pick, axis=-1)
            count += F * top_k
            parent_out = mx.take_along_axis(outputs, from_slot[..., None], axis=1)
            slots = ancestry.shape[1]
            if level == 1:  # children of the root: no drafted ancestors
                inherited = mx.zeros((B, top_k, slots), dtype=mx.bool_)
            else:
                inherited = mx.take_along_axis(ancestry, (slots - F + from_slot)[..., None], axis=1)
            own = mx.broadcast_to(mx.eye(top_k, dtype=mx.bool_), (B, top_k, top_k))
            new = mx.concatenate([inherited, own], axis=-1)
            ancestry = mx.concatenate([mx.pad(ancestry, [(0, 0), (0, 0), (0, top_k)]), new], axis=1)
            embeds = self.embed(mx.take_along_axis(tokens[-1], pick, axis=-1))
            outputs, nodes = self.head.draft_step(parent_out, embeds, self.rows.cache.layers[0], level, nodes, new)
        tokens, parents, scores = (mx.concatenate(a, axis=1) for a in (tokens, parents, scores))
        mx.eval(tokens, parents, scores)
        tokens, parents, scores = tokens.tolist(), parents.tolist(), scores.tolist()
        candidates = [list(zip(tokens[b], parents[b], scores[b])) for b in range(B)]
        return [None if not drafting[b] else self._chain(candidates[b]) if chains[b] else
                self._tree(candidates[b], budget) for b in range(B)]

    def _logprobs(self, out: mx.array) -> mx.array:
        logits = self.head.logits(out, self.lm_head).astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    @staticmethod
    def _chain(cand: list[tuple[int, int, float]]) -> DraftTree:
        """The most likely child at every depth, as far as the expansion kept it."""
        tokens, node = [], -1
        while children := [c for c, (_, parent, _) in enumerate(cand) if parent == node]:
            node = max(children, key=lambda c: cand[c][2])
            tokens.append(cand[node][0])
        return DraftTree.chain(tokens)

    @staticmethod
    def _tree(cand: list[tuple[int, int, float]], budget: int) -> DraftTree:
        """The ``budget`` best candidates by cumulative log-probability, as a
        tree in depth order (a child never scores above its parent and comes
        after it, so the kept ones are closed under parents)."""
        kept = sorted(range(len(cand)), key=lambda c: -cand[c][2])[:budget]
        depth: dict[int, int] = {}
        for c, (_, parent, _) in enumerate(cand):
            depth[c] = 1 if parent < 0 else depth[parent] + 1
        order = sorted(kept, key=lambda c: (depth[c], c))
        index = {c: i for i, c in enumerate(order)}
        return DraftTree([cand[c][0] for c in order], [index[cand[c][1]] if cand[c][1] >= 0 else -1 for c in order])


def pair_keys(tokens: list[int]) -> list[int]:
    """The head's entry i follows tokens i and i+1: its cache is keyed by the pairs."""
    return [(a << 31) | b for a, b in zip(tokens, tokens[1:])]
