"""Compiled stand-ins for the fast ops that MLX's CPU backend builds from many small ones.

On a GPU, ``mx.fast.rms_norm``, ``mx.fast.layer_norm`` and ``mx.fast.rope`` are one kernel each.
MLX's CPU backend has none of them: every call expands into its fallback, about ten graph nodes
for a norm and thirty for RoPE, and each node is a dispatch on the CPU stream, which in a small
model's decode or draft step costs more than the node's arithmetic. The same fallback traced by
``mx.compile`` is a few nodes, its elementwise ops fused into one pass, and gives the same
numbers bit for bit (``ops/bench/cpu_fast.py`` times both). Its fused pass, though, runs slower
per element than MLX's own ops, so it pays only on small arrays, where the dispatches outweigh
the arithmetic.

``install`` puts ``rms_norm``, ``layer_norm`` and ``rope`` in ``mx.fast`` in their place, once per
process; they defer to MLX's own off the CPU: mlx-lm's families reach them through ``mx.fast``,
from their own modules and from ``mlx.nn``'s layers. A call on an array of at most
``NORM_ELEMENTS`` (a norm) or ``ROPE_ELEMENTS`` elements (a small model's decode, verify or draft
step; its shapes repeat step after step) takes the compiled version, kept per shape
(``COMPILED_SHAPES`` of them, the least recently used dropped); a larger one (a prefill chunk, a
large model's step) takes MLX's own. RoPE at a Python ``int`` offset takes MLX's own too:
compiled, each offset would be a trace of its own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import mlx.core as mx

# The largest arrays whose calls are compiled: past them the compiled elementwise ops' slower
# pass costs more than the dispatches saved (``ops/bench/results/cpu_fast.json``)
NORM_ELEMENTS = 2048
ROPE_ELEMENTS = 8192
COMPILED_SHAPES = 512  # compiled functions kept, by op, settings and input shapes

_ORIGINAL = {"rms_norm": mx.fast.rms_norm, "layer_norm": mx.fast.layer_norm, "rope": mx.fast.rope}
_compiled: OrderedDict[tuple, Callable] = OrderedDict()
_lock = threading.Lock()  # steps of several engines (threads) share the cache


def _signature(*arrays: mx.array | None) -> tuple:
    return tuple(None if a is None else (a.shape, a.dtype) for a in arrays)


def _compiled_for(key: tuple, make: Callable[[], Callable]) -> Callable:
    """The compiled function for ``key``, made (``make``) the first time it is met."""
    with _lock:
        function = _compiled.get(key)
        if function is None:
            function = _compiled[key] = mx.compile(make())
            if len(_compiled) > COMPILED_SHAPES:
                _compiled.popitem(last=False)
        else:
            _compiled.move_to_end(key)
        return function


def _pays(x: mx.array, elements: int, stream) -> bool:
    """Whether compiling a call pays: on the CPU, on at most ``elements`` elements."""
    return stream is None and x.size <= elements and mx.default_device() == mx.cpu


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream=None) -> mx.array:
    original = _ORIGINAL["rms_norm"]
    if not _pays(x, NORM_ELEMENTS, stream):
        return original(x, weight, eps, stream=stream)
    key = ("rms_norm", eps, _signature(x, weight))
    weights = () if weight is None else (weight,)
    return _compiled_for(key, lambda: lambda x, *w: original(x, w[0] if w else None, eps))(x, *weights)


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float, *,
               stream=None) -> mx.array:
    original = _ORIGINAL["layer_norm"]
    if not _pays(x, NORM_ELEMENTS, stream):
        return original(x, weight, bias, eps, stream=stream)
    key = ("layer_norm", eps, _signature(x, weight, bias))
    given = [a for a in (weight, bias) if a is not None]

    def make() -> Callable:
        def norm(x: mx.array, *parameters: mx.array) -> mx.array:
            rest = iter(parameters)
            return original(x, next(rest) if weight is not None else None, next(rest) if bias is not None else None,
                            eps)
        return norm
    return _compiled_for(key, make)(x, *given)


def rope(a: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float, offset,
         freqs: mx.array | None = None, stream=None) -> mx.array:
    original = _ORIGINAL["rope"]
    if not (isinstance(offset, mx.array) and _pays(a, ROPE_ELEMENTS, stream)):
        return original(a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs,
                        stream=stream)
    key = ("rope", dims, traditional, base, scale, _signature(a, offset, freqs))
    given = () if freqs is None else (freqs,)
    return _compiled_for(key, lambda: lambda a, offset, *f: original(
        a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=f[0] if f else None))(
            a, offset, *given)


_installed = False


def install() -> None:
    """Put the compiled stand-ins in ``mx.fast`` (once; they defer to MLX's own off the CPU)."""
    global _installed
    if _installed:
        return
    mx.fast.rms_norm, mx.fast.layer_norm, mx.fast.rope = rms_norm, layer_norm, rope
    _installed = True
