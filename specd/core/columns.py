"""Columns of an attention layer's keys or values, plain or quantized: the arrays a
KV cache stores and attention reads, and what they cost in memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import mlx.core as mx

STEP = 64  # columns a row's buffer grows by: a short row wastes little, a long one regrows rarely

# One side (keys or values) of some columns, (rows, kv heads, n, D): an array, or the
# parts ``mx.quantize`` makes of it (packed weights, scales, biases) when the KV is quantized.
Side = Union[mx.array, tuple[mx.array, ...]]


@dataclass(frozen=True)
class KVQuantization:
    """Keys and values stored quantized, as mlx-lm's ``QuantizedKVCache`` stores them."""

    bits: int = 8
    group_size: int = 64


def parts(side: Side) -> tuple[mx.array, ...]:
    return side if isinstance(side, tuple) else (side,)


def like(side: Side, arrays: list[mx.array]) -> Side:
    """``arrays`` as a side of the same kind as ``side`` (plain or quantized)."""
    return tuple(arrays) if isinstance(side, tuple) else arrays[0]


def side_slice(side: Side, start: int, end: int) -> Side:
    """Columns [start, end)."""
    return like(side, [a[..., start:end, :] for a in parts(side)])


def pair_slice(pair: tuple[Side, Side], start: int, end: int | None = None) -> tuple[Side, Side]:
    """Columns [start, end) (by default to the last) of a layer's keys and values."""
    keys, values = pair
    end = side_columns(keys) if end is None else end
    return side_slice(keys, start, end), side_slice(values, start, end)


def side_concat(sides: list[Side], axis: int = 2) -> Side:
    """Columns of several pieces, in order (one piece as it is: no copy); ``axis=0``: rows."""
    if len(sides) == 1:
        return sides[0]
    return like(sides[0], [mx.concatenate(group, axis=axis) for group in zip(*map(parts, sides))])


def pair_concat(pairs: list[tuple[Side, Side]]) -> tuple[Side, Side]:
    """A layer's keys and values of several consecutive pieces, as one (one piece as it is: no copy)."""
    return side_concat([k for k, _ in pairs]), side_concat([v for _, v in pairs])


def side_columns(side: Side) -> int:
    return parts(side)[0].shape[2]


def side_bytes(side: Side) -> int:
    return sum(a.nbytes for a in parts(side))


def stored(side: mx.array, quantization: KVQuantization | None) -> Side:
    """Columns as a cache stores them: as they are, or what ``mx.quantize`` makes of them."""
    q = quantization
    return side if q is None else tuple(mx.quantize(side, group_size=q.group_size, bits=q.bits))


def product(x: mx.array, side: Side, transpose: bool, quantization: KVQuantization | None) -> mx.array:
    """``x @ side`` (``side`` transposed if asked), dequantizing quantized columns as mlx-lm does."""
    if quantization is None:
        return x @ (side.swapaxes(-1, -2) if transpose else side)
    return mx.quantized_matmul(x, *side, transpose=transpose, group_size=quantization.group_size,
                               bits=quantization.bits)


def side_copy(side: Side) -> Side:
    """A copy that shares no buffer with ``side``."""
    return like(side, [mx.contiguous(a) for a in parts(side)])


def regrown(kept: Side | None, shape_of: Side, need: int, rows: int = 1) -> Side:
    """A buffer of ``rows`` rows for ``need`` columns (rounded up to ``STEP``), shaped like
    ``shape_of`` (its heads, widths and dtype), starting with the columns ``kept``."""
    capacity = -(-need // STEP) * STEP
    fresh = [mx.zeros((rows, a.shape[1], capacity, a.shape[3]), dtype=a.dtype) for a in parts(shape_of)]
    if kept is not None and side_columns(kept):
        for a, k in zip(fresh, parts(kept)):
            a[..., :k.shape[2], :] = k
    return like(shape_of, fresh)


Columns = list[tuple[Side, Side]]  # per attention layer: (1, H, n, D) keys and values (or their quantized parts)
Pieces = list[tuple[Side, Side]]  # one layer's columns of a row in consecutive pieces (read in place, not copied)


def pieces_between(pieces: Pieces, start: int, end: int | None = None) -> Pieces:
    """Columns [start, end) (by default to the last) of a row's consecutive pieces, in pieces
    (views, never copies)."""
    out, at = [], 0
    for k, v in pieces:
        n = side_columns(k)
        lo, hi = max(start - at, 0), n if end is None else min(end - at, n)
        at += n
        if hi > lo:
            out.append((k, v) if (lo, hi) == (0, n) else pair_slice((k, v), lo, hi))
    return out
