"""The per-row cache protocol, over every cache kind mlx-lm's models use.

A continuous batch decodes sequences of different lengths together, and
speculation keeps a different number of proposed tokens in every row, so
every cache the speculator touches, the target's and every drafter's,
speaks one protocol (``RowCache``): the model's forward appends columns to
every row, then each row rolls back or forgets its own rejected columns, and
rows are selected and merged as sequences leave and join.

``BatchRowCache`` implements it over a model's own layer caches, batched:

- attention (``KVCache``) and sliding-window attention (``RotatingKVCache``)
  become ``RowKV`` layers (``core.kv``): each row's keys and values in its own
  buffer, attended row by row, so rollback shortens a row and rows join and
  leave without copying the others;
- recurrent state (``ArraysCache``: Mamba SSM and conv states, gated delta
  nets, short convs) stays mlx-lm's ``ArraysCache``, which batches and masks
  padding itself but has no columns to hide: the state before a provisional
  forward is kept, and rollback restores it and re-advances each row over its
  accepted tokens only;
- ``CacheList`` (Falcon-H1) holds one of each, and each member follows its kind.

A model whose forward cannot take rows at different positions at all runs
row by row over mlx-lm's own caches (``RowwiseCache``): Llama 4 (its
chunked-attention mask and its NoPE layers' temperature read one offset for
the whole batch), DeepSeek V4 (one ``start_pos`` for the batch's sliding
window, compressor and indexer; its ``LayerCache`` cannot be trimmed, so a
row rolls back by restoring its caches and running its kept tokens again),
and any model whose rows, decoded together, are found at its first cache to
differ from each row alone (``runs_row_by_row``).

A fresh row may start from a cached prefix (``RowPrefix``, what the prefix
cache in ``core.prefix`` restores), and what a row holds (``row_columns``,
``row_snapshot``) is what that cache records.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.deepseek_v41 import LayerCache as CompressedLayerCache

from .columns import Columns, KVQuantization, Pieces
from .kv import RowKV, route_attention

Snapshot = list[list]  # per recurrent layer: its state arrays, batch of 1


@dataclass
class RowPrefix:
    """A cached prefix a new batch row starts from: ``length`` tokens, each
    attention layer's columns for the positions it will still attend to
    (in the nodes' pieces), and the recurrent layers' state after them."""

    length: int
    columns: list[Pieces]
    snapshot: Snapshot | None = None
    in_place: int = 0  # the row reads the columns of positions before this in place, and copies the others


class RowCache(Protocol):
    """A model's batched cache, every layer, one row per sequence.

    ``forward(model, inputs, provisional)`` runs the model over it, appending
    the same number of columns to every row; a ``provisional`` forward's
    columns may be rolled back.  After it:

    - ``rollback(rejected)`` drops row b's last ``rejected[b]`` columns, so
      each row holds exactly its accepted tokens and no row is cut short
      because of another;
    - ``forget(drop)`` drops any of the last columns per row (a draft tree
      keeps one path of its nodes; ``chains_only`` caches cannot);
    - ``select(rows)`` keeps and reorders rows, ``merge(other)`` appends
      another cache's rows (a sequence leaves or joins between steps);
    - ``settle()`` evaluates what rollback left lazy so the step that rolled
      back pays for it;
    - ``tree_attention(ancestry)`` restricts the next forward's new columns
      to their ancestors (draft trees).
    """

    chains_only: bool

    @property
    def state(self) -> list:
        """Every array the cache holds (evaluated after a prefill chunk)."""

    @property
    def nbytes(self) -> int:
        """Bytes its rows hold (what counts against the Model's KV budget)."""

    def shared_tokens(self, b: int) -> int:
        """Tokens row b reads in place from the prefix cache in every layer (held there, not by the row)."""

    def forward(self, model: nn.Module, inputs: mx.array, provisional: bool = False,
                embeddings: mx.array | None = None) -> mx.array:
        """The model's logits over ``inputs`` (B, width); ``embeddings`` (B, width, hidden), where
        given, are the model's input embeddings instead of the tokens' (a prompt's images)."""

    def rollback(self, rejected: list[int]) -> None: ...

    def forget(self, drop: np.ndarray) -> None: ...

    def select(self, rows: list[int]) -> None: ...

    def merge(self, other: "RowCache") -> None: ...

    def shift(self, shifts: list[int]) -> None: ...

    def settle(self) -> None: ...

    def tree_attention(self, ancestry: mx.array): ...

    def allow_padding(self, columns: int) -> None:
        """Columns of padding the KV budget has room for beyond the rows' own (a block layout's)."""

    def reserve(self, columns: list[int]) -> None:
        """Each row's own columns to come (a prefill's whole context and a round's growth; 0: none
        named): its buffers grow to them at their next growth, rather than chunk by chunk, each
        growth a copy of every column held beside the old buffer."""


class BatchRowCache:
    """``RowCache`` over a model's layer caches (``layers``, what its forward
    takes as ``cache=``), attention and recurrent mixed as the model mixes them."""

    def __init__(self, layers: list, padding: int = 0):
        self.layers = layers
        leaves = list(_leaves(layers))
        by_window: dict[int | None, list[RowKV]] = {}
        for leaf in leaves:
            if isinstance(leaf, RowKV):
                by_window.setdefault(leaf.window, []).append(leaf)
        # layers of one window hold the same columns: the model builds one mask for all of them
        self.attention = list(by_window.values())
        self.recurrent = [leaf for leaf in leaves if isinstance(leaf, ArraysCache)]
        self.chains_only = bool(self.recurrent)
        self._padding = padding  # prompt columns still to come that some recurrent row masks as padding
        self._model: nn.Module | None = None
        self._journal: list[mx.array] = []  # inputs of the provisional forwards since the last rollback
        self._saved: list[list] = []  # the recurrent states before them

    def forward(self, model: nn.Module, inputs: mx.array, provisional: bool = False,
                embeddings: mx.array | None = None) -> mx.array:
        if not self._journal:
            for group in self.attention:
                if group[0].needs_eviction():
                    for leaf in group:
                        leaf.evict()
        if provisional and self.recurrent:
            if not self._journal:
                self._model = model
                self._saved = [list(leaf.cache) for leaf in self.recurrent]
            self._journal.append(inputs)
        logits = model(inputs, cache=self.layers, **_embedded(embeddings))
        if self._padding > 0:
            self._padding -= inputs.shape[1]
            if self._padding <= 0:  # every row is past its padding: no mask, the faster kernels
                for leaf in self.recurrent:
                    leaf.left_padding = None
        return logits

    def rollback(self, rejected: list[int]) -> None:
        width = max(rejected, default=0)
        self.forget(np.arange(width)[None, :] >= width - np.array(rejected)[:, None])

    def forget(self, drop: np.ndarray) -> None:
        """Forget, in each row b, the last ``width`` columns where ``drop[b]``
        (B, width) is set."""
        if self._journal:
            if drop.any():
                drop = self._readvance(drop)
            self._journal, self._saved = [], []
        if not drop.any():
            return
        for leaf in self._attention():
            leaf.forget(drop)

    def _readvance(self, drop: np.ndarray) -> np.ndarray:
        """Restore the recurrent states from before the provisional forwards
        and run the model again over the kept columns, in segments that end
        where some row's kept columns end: each row takes its recurrent state
        from the end of its own segment (no padding masks, which not every
        family applies to its state), and the attention layers rewrite the
        same columns.  Returns what the attention layers must drop after it."""
        kept = _kept_prefix(drop)
        inputs = self._journal[0] if len(self._journal) == 1 else mx.concatenate(self._journal, axis=1)
        written = inputs.shape[1]
        keep = kept + (written - drop.shape[1])  # per row, of all the provisional columns
        for leaf, saved in zip(self.recurrent, self._saved):
            leaf.cache = list(saved)
        for leaf in self._attention():
            leaf.trim(written)
        chosen = [list(saved) for saved in self._saved]
        done = 0
        for end in sorted(set(keep.tolist())):
            if end > done:
                self._model(inputs[:, done:end], cache=self.layers)
                done = end
            rows = mx.array(keep == end)
            for leaf, picked in zip(self.recurrent, chosen):
                for i, state in enumerate(leaf.cache):
                    if state is not None:
                        picked[i] = mx.where(rows.reshape(-1, *[1] * (state.ndim - 1)), state, picked[i])
        for leaf, picked in zip(self.recurrent, chosen):
            leaf.cache = picked
        return np.arange(done)[None, :] >= keep[:, None]

    def select(self, rows: list[int]) -> None:
        for leaf in self._attention():
            leaf.select(rows)
        for leaf in self.recurrent:
            leaf.filter(mx.array(rows))

    def merge(self, other: "BatchRowCache") -> None:
        for mine, theirs in zip(self._attention() + self.recurrent, other._attention() + other.recurrent):
            mine.extend(theirs)

    def settle(self) -> None:
        """Evaluate what rolling back left lazy (a tree's closed-up columns,
        re-advanced states), so that the step that
        rolled back pays for it: the controller compares whole steps' times,
        and deferred work would be billed to the next step, which during a
        try from plain decoding is a plain one, making speculation look
        cheaper than it is."""
        mx.eval(self.state)

    @property
    def state(self) -> list:
        arrays = [a for leaf in self._attention() for a in leaf.arrays]
        return arrays + [a for leaf in self.recurrent for a in leaf.cache if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def shift(self, shifts: list[int]) -> None:
        """Each row's RoPE offset moved ``shifts[b]`` positions on (``RowKV.shift``)."""
        for group in self.attention:
            for leaf in group:
                leaf.shift(shifts)

    def shared_tokens(self, b: int) -> int:
        return min((group[0].shared_columns[b] for group in self.attention), default=0)  # a group's layers alike

    @contextmanager
    def tree_attention(self, ancestry: mx.array) -> Iterator[None]:
        for leaf in self._attention():
            leaf.tree = ancestry
        try:
            yield
        finally:
            for leaf in self._attention():
                leaf.tree = None

    def allow_padding(self, columns: int) -> None:
        for leaf in self._attention():
            leaf.room = columns

    def reserve(self, columns: list[int]) -> None:
        for leaf in self._attention():
            if leaf.window is None:  # a window's layers hold no more than the window after a round
                leaf.reserved = list(columns)

    def _attention(self) -> list[RowKV]:
        return [leaf for group in self.attention for leaf in group]

    # -- prefix caching: rows out of and into the cache ----------------------------

    @property
    def windows(self) -> list[int | None]:
        """Each attention layer's sliding window (None: full attention), in column order."""
        return [leaf.window for group in self.attention for leaf in group]

    def row_columns(self, b: int, start: int, end: int) -> Columns | None:
        """Row b's keys and values of positions [start, end) in every
        attention layer; None if a sliding window already evicted some of them."""
        out = []
        for leaf in self._attention():
            pair = leaf.columns(b, start, end)
            if pair is None:
                return None
            out.append(pair)
        return out

    def row_snapshot(self, b: int) -> Snapshot:
        """Row b's recurrent state, every recurrent layer."""
        return [[None if a is None else a[b:b + 1] for a in leaf.cache] for leaf in self.recurrent]

    def restore(self, prefixes: list[RowPrefix | None]) -> None:
        """Start the (fresh) rows from cached prefixes; the columns still to
        come (a row's own left padding first) follow them."""
        for i, leaf in enumerate(self._attention()):
            for b, prefix in enumerate(prefixes):
                if prefix is not None:
                    leaf.restore(b, prefix.columns[i], prefix.length, prefix.in_place)
        for j, leaf in enumerate(self.recurrent):
            states = [p.snapshot[j] if p is not None and p.snapshot else None for p in prefixes]
            template = next(filter(None, states), None)
            if template is None:
                continue
            leaf.cache = [None if t is None else mx.concatenate(
                [s[e] if s is not None else mx.zeros_like(t) for s in states]) for e, t in enumerate(template)]


def _kept_prefix(drop: np.ndarray) -> np.ndarray:
    """How many of the last ``drop.shape[1]`` columns each row keeps, when
    every row drops only a suffix of them (a chain's rejected tail)."""
    kept = drop.shape[1] - drop.sum(axis=1)
    if (drop != (np.arange(drop.shape[1])[None, :] >= kept[:, None])).any():
        raise ValueError("this cache drops only a row's last columns (draft chains, not trees)")
    return kept


def _leaves(layers: list) -> Iterator:
    for layer in layers:
        if isinstance(layer, CacheList):
            yield from _leaves(list(layer.caches))
        else:
            yield layer


def _embedded(embeddings: mx.array | None) -> dict:
    """The keyword a forward takes its input embeddings by (none given: the model embeds the tokens)."""
    return {} if embeddings is None else {"input_embeddings": embeddings}


# Cache kinds whose forward reads one position for the whole batch: their rows run alone.
ROWWISE_KINDS = (ChunkedKVCache, CompressedLayerCache)


class RowwiseCache:
    """``RowCache`` as one mlx-lm cache list per row, the model run row by
    row: for models whose forward reads one position for the whole batch.
    Prompt padding is skipped, not fed. Rollback trims a row's caches where
    each provisional forward leaves them trimmable; otherwise (DeepSeek V4's
    compressed groups, a sliding window that has wrapped or that a forward
    wraps) the row's caches as they were before are kept, as copies whose
    arrays no in-place write reaches, and a row that rejected columns gets
    them back and runs its kept columns again."""

    chains_only = True

    def __init__(self, model: nn.Module, left_padding: list[int]):
        self.rows = [make_prompt_cache(model) for _ in left_padding]
        self.padding = list(left_padding)  # per row: padding columns still to come
        self._model: nn.Module | None = None
        self._journal: list[mx.array] = []  # inputs of the provisional forwards since the last rollback
        self._saved: list[list | None] = []  # each row's caches before them (None: the row trims)

    def forward(self, model: nn.Module, inputs: mx.array, provisional: bool = False,
                embeddings: mx.array | None = None) -> mx.array:
        width = inputs.shape[1]
        if provisional:
            if not self._journal:
                self._model, self._saved = model, [None] * len(self.rows)
            for b, cache in enumerate(self.rows):
                if self._saved[b] is None and not all(_trims_after(layer, width) for layer in cache):
                    self._saved[b] = self._before_journal(b)
            self._journal.append(inputs)
        outs = []
        for b, cache in enumerate(self.rows):
            skip = min(self.padding[b], width)
            self.padding[b] -= skip
            row = _embedded(None if embeddings is None else embeddings[b: b + 1, skip:])
            outs.append(model(inputs[b: b + 1, skip:], cache=cache, **row) if skip < width else None)
        real = next(o for o in outs if o is not None)
        return mx.concatenate([mx.zeros((1, width, real.shape[-1]), real.dtype) if o is None else
                               mx.pad(o, [(0, 0), (width - o.shape[1], 0), (0, 0)]) for o in outs])

    def _before_journal(self, b: int) -> list:
        """Row b's caches as they were before this step's provisional forwards, as copies; the
        row is left as it is now. Its caches trimmed exactly until now, so they are trimmed back,
        copied, and run again over the journal."""
        written = sum(inputs.shape[1] for inputs in self._journal)
        if not written:
            return _detached(self.rows[b])
        for layer in self.rows[b]:
            layer.trim(written)
        saved = _detached(self.rows[b])
        self._model(mx.concatenate([inputs[b: b + 1] for inputs in self._journal], axis=1), cache=self.rows[b])
        return saved

    def shift(self, shifts: list[int]) -> None:
        if any(shifts):
            raise ValueError("a model run row by row keeps one RoPE offset per row cache: it cannot shift them")

    def rollback(self, rejected: list[int]) -> None:
        written = sum(inputs.shape[1] for inputs in self._journal)
        for b, r in enumerate(rejected):
            if not r:
                continue
            if self._journal and self._saved[b] is not None:
                self.rows[b] = self._saved[b]
                if written > r:
                    inputs = mx.concatenate([inputs[b: b + 1] for inputs in self._journal], axis=1)
                    self._model(inputs[:, : written - r], cache=self.rows[b])
            else:
                for layer in self.rows[b]:
                    layer.trim(r)
        self._journal, self._saved = [], []

    def forget(self, drop: np.ndarray) -> None:
        self.rollback((drop.shape[1] - _kept_prefix(drop)).tolist())

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        self.padding = [self.padding[i] for i in rows]

    def merge(self, other: "RowwiseCache") -> None:
        self.rows += other.rows
        self.padding += other.padding

    def settle(self) -> None:
        mx.eval(self.state)

    @property
    def state(self) -> list:
        return [a for cache in self.rows for layer in cache for a in vars(layer).values() if isinstance(a, mx.array)]

    @property
    def nbytes(self) -> int:
        return sum(_layer_bytes(layer) for cache in self.rows for layer in cache)

    def shared_tokens(self, b: int) -> int:
        return 0  # mlx-lm's caches: a row holds all its columns

    def allow_padding(self, columns: int) -> None:
        """Rows run one by one: none is padded."""

    def reserve(self, columns: list[int]) -> None:
        """mlx-lm's caches grow their own way."""

    def tree_attention(self, ancestry: mx.array):
        raise ValueError("a row-by-row cache verifies draft chains only")


def _trims_after(layer, width: int) -> bool:
    """Whether an mlx-lm cache layer can be trimmed back exactly after a forward of ``width`` more
    columns. A sliding window can only while the forward leaves it unwrapped: mlx-lm's trim moves
    the window's write index but keeps the columns the forward wrote, and a write past the window
    overwrites its oldest columns, which a row rolled back may still attend to."""
    if isinstance(layer, CacheList):
        return all(_trims_after(member, width) for member in layer.caches)
    if isinstance(layer, RotatingKVCache):
        return layer.offset + width <= layer.max_size
    return layer.is_trimmable()


def _layer_bytes(layer) -> int:
    """An mlx-lm cache layer's bytes: its own count, or the arrays it holds where its kind keeps none."""
    try:
        return layer.nbytes
    except NotImplementedError:
        return sum(a.nbytes for a in vars(layer).values() if isinstance(a, mx.array))


def _detached(value):
    """A copy of an mlx-lm cache (or what it holds) that later in-place writes to it do not reach."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if hasattr(value, "is_trimmable"):  # a cache layer (DeepSeek V4's LayerCache is not a _BaseCache)
        saved = copy.copy(value)
        for name, held in vars(value).items():
            setattr(saved, name, _detached(held))
        return saved
    return value


def make_row_cache(model: nn.Module, left_padding: list[int], prefixes: list[RowPrefix | None] | None = None,
                   quantization: KVQuantization | None = None) -> BatchRowCache | RowwiseCache:
    """The model's own caches (``make_prompt_cache``), each batched with rows
    left-padded by ``left_padding`` (and starting from ``prefixes``), its
    attention layers' keys and values stored quantized if asked, or row by row
    (``runs_row_by_row``: mlx-lm's caches, in full precision); refuses kinds
    that cannot batch."""
    if runs_row_by_row(model):
        if prefixes and any(prefixes):
            raise ValueError("a row-by-row cache starts from no cached prefix")
        return RowwiseCache(model, left_padding)
    caches = make_prompt_cache(model)
    cache = BatchRowCache([_batched(c, list(left_padding), quantization) for c in caches], max(left_padding))
    if prefixes and any(prefixes):
        cache.restore(prefixes)
    return cache


def runs_row_by_row(model: nn.Module) -> bool:
    """Whether ``model``'s rows must run one at a time: its caches are of a kind whose
    forward reads one position for the whole batch, its attention does not come
    through ``core.kv.row_attention`` (OLMo calls MLX's kernel itself), or two rows of
    different lengths decoded together do not give the logits each gives alone
    (Gemma 2, AFM 7 and StarCoder's ``gpt_bigcode`` read positions from the batch's
    width, not each row's). Decided once, at the model's first cache, and
    remembered on the model."""
    decided = getattr(model, "_specd_row_by_row", None)
    if decided is None:
        route_attention(model)
        caches = make_prompt_cache(model)
        decided = any(isinstance(c, ROWWISE_KINDS) for c in caches) or not _decodes_rows_exactly(model)
        model._specd_row_by_row = decided
    return decided


def _decodes_rows_exactly(model: nn.Module) -> bool:
    """Two prompts prefilled apart, merged into one batch as the scheduler merges rows, then
    one decoding step: every attention layer attended through ``RowKV`` and the logits are
    within float noise of each row's under mlx-lm's own caches (a tenth of the logits'
    spread; a model that reads the wrong positions is off by about the spread itself)."""
    prompts = ([2, 3, 4, 5, 6, 7, 8], [9, 10, 11])

    def alone(prompt: list[int]) -> mx.array:
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        return model(mx.array([[1]]), cache=cache)[:, -1]

    reference = mx.concatenate([alone(prompt) for prompt in prompts])
    caches = []
    try:
        for prompt in prompts:
            cache = BatchRowCache([_batched(c, [0]) for c in make_prompt_cache(model)])
            cache.forward(model, mx.array([prompt]))
            caches.append(cache)
        for other in caches[1:]:
            caches[0].merge(other)
        together = caches[0].forward(model, mx.array([[1]] * len(prompts)))[:, -1]
    except Exception:  # a forward that cannot take these caches at all (reads what RowKV does not keep)
        return False
    if not all(leaf.attends for leaf in caches[0]._attention()):
        return False
    return mx.abs(together - reference).max().item() <= 0.1 * mx.std(reference).item()


def padding_leaks(model: nn.Module) -> bool:
    """Whether what a row's left padding holds reaches the row's output.

    A family must mask padding everywhere its forward mixes positions; one
    that misses a place (OLMo Hybrid's short convolutions take the padded
    columns as input) gives a padded row other tokens than the same prompt
    alone. Two forwards of one padded row that differ only in the padding's
    token ids show it exactly: same shapes and kernels, so masked padding
    gives identical logits and any difference is a leak."""
    logits = [make_row_cache(model, [4]).forward(model, mx.array([[pad] * 4 + [2, 3, 4, 5]]))[:, -1]
              for pad in (0, 1)]
    return not mx.array_equal(*logits).item()


def _batched(cache, padding: list[int], quantization: KVQuantization | None = None):
    if type(cache) is KVCache:
        return RowKV(padding, quantization=quantization)
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise ValueError(f"a sliding window that keeps {cache.keep} sink tokens cannot batch")
        return RowKV(padding, window=cache.max_size, quantization=quantization)
    if isinstance(cache, ArraysCache):
        return ArraysCache(len(cache.cache), left_padding=padding if any(padding) else None)
    if isinstance(cache, CacheList):
        return CacheList(*(_batched(c, padding, quantization) for c in cache.caches))
    raise ValueError(f"continuous batching does not support {type(cache).__name__} caches yet")


def kv_bytes(model: nn.Module, quantization: KVQuantization | None = None) -> tuple[int, int]:
    """What one row of ``model`` holds: (bytes per token, its keys and values in
    every attention layer, quantized if asked; bytes of its recurrent state,
    whatever its length). Read from mlx-lm's own caches after one token, so
    every family's shapes (grouped heads, latent attention, mixed layer kinds)
    count as they are."""
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))  # now: a lazy array left on the model belongs to this thread
    per_token = state = 0
    for leaf in _leaves(caches):
        keys, values = getattr(leaf, "keys", None), getattr(leaf, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4:
            per_token += sum(side_token_bytes(a.shape[1], a.shape[3], a.itemsize, quantization) for a in (keys, values))
        elif isinstance(leaf, ArraysCache):
            state += sum(a.nbytes for a in leaf.cache if a is not None)
    return per_token, state


def side_token_bytes(heads: int, dims: int, itemsize: int, quantization: KVQuantization | None) -> int:
    """One side (keys or values) of one token in one layer; quantized: packed bits plus a scale and a
    bias (of the model's dtype) per group."""
    if quantization is None:
        return heads * dims * itemsize
    return heads * (dims * quantization.bits // 8 + 2 * (dims // quantization.group_size) * itemsize)
