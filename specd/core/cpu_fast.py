"""Compiled stand-ins for the fast ops that MLX's CPU backend builds from many small ones.

On a GPU, ``mx.fast.rms_norm``, ``mx.fast.layer_norm`` and ``mx.fast.rope`` are one kernel each.
MLX's CPU backend has none of them: every call expands into its fallback, about ten graph nodes
for a norm and thirty for RoPE, and each node is a dispatch on the CPU stream, which in a small
model's decode or draft step costs more than the node's arithmetic. The same fallback traced by
``mx.compile`` is a few nodes, its elementwise ops fused into one pass, and gives the same
numbers bit for bit (``ops/bench/cpu_fast.py`` times both).

``install`` puts ``rms_norm``, ``layer_norm`` and ``rope`` in ``mx.fast`` in their place, once per
process, where the default device is the CPU: mlx-lm's families reach them through ``mx.fast``,
from their own modules and from ``mlx.nn``'s layers. A call of a decode, verify or draft step
(at most ``MAX_COLUMNS`` columns a row; its shapes repeat step after step) takes the compiled
version, kept per shape (``COMPILED_SHAPES`` of them, the least recently used dropped); a prefill
chunk's (many columns; its lengths seldom repeat, and its arithmetic dwarfs the dispatches) takes
MLX's own. RoPE at a Python ``int`` offset takes MLX's own too: compiled, each offset would be a
trace of its own. Elsewhere (a GPU) nothing changes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import mlx.core as mx

MAX_COLUMNS = 16  # a step's columns a row (x.shape[-2]) up to which a call is compiled
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


def _repeats(x: mx.array, stream) -> bool:
    """Whether a call is a step's (few columns a row) on the CPU, where compiling it pays."""
    return stream is None and x.ndim >= 2 and x.shape[-2] <= MAX_COLUMNS and mx.default_device() == mx.cpu


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream=None) -> mx.array:
    original = _ORIGINAL["rms_norm"]
    if not _repeats(x, stream):
        return original(x, weight, eps, stream=stream)
    key = ("rms_norm", eps, _signature(x, weight))
    if weight is None:
        return _compiled_for(key, lambda: lambda x: original(x, None, eps))(x)
    return _compiled_for(key, lambda: lambda x, w: original(x, w, eps))(x, weight)


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float, *,
               stream=None) -> mx.array:
    original = _ORIGINAL["layer_norm"]
    if not _repeats(x, stream):
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
    if not (isinstance(offset, mx.array) and _repeats(a, stream)):
        return original(a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs,
                        stream=stream)
    key = ("rope", dims, traditional, base, scale, _signature(a, offset, freqs))
    if freqs is None:
        return _compiled_for(key, lambda: lambda a, offset: original(
            a, dims, traditional=traditional, base=base, scale=scale, offset=offset))(a, offset)
    return _compiled_for(key, lambda: lambda a, offset, freqs: original(
        a, dims, traditional=traditional, base=None, scale=scale, offset=offset, freqs=freqs))(a, offset, freqs)


_installed = False


def install() -> None:
    """Put the compiled stand-ins in ``mx.fast`` (once; they defer to MLX's own off the CPU)."""
    global _installed
    if _installed:
        return
    mx.fast.rms_norm, mx.fast.layer_norm, mx.fast.rope = rms_norm, layer_norm, rope
    _installed = True
