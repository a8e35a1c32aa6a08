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
step; its shapes repeat step after step) takes the compiled version; a larger one (a prefill chunk,
a large model's step) takes MLX's own. RoPE at a Python ``int`` offset takes MLX's own too:
compiled, each offset would be a trace of its own.

Each op is one module-level compiled function that takes its settings (``eps``, ``dims``, ``base``
and the rest) as arguments, so MLX keys its traces by them as well as by the shapes. A compiled
function made per setting and dropped later would not be safe: MLX keeps traces in a cache per
thread, keyed by the traced function's address, and dropping a compiled function clears only the
last calling thread's cache, so another engine's thread could later find a stale trace (another
``eps``, another ``dims``) under a new function at the same address. The size limits bound the
shapes, so each thread's traces stay few.
"""

from __future__ import annotations

import mlx.core as mx

# The largest arrays whose calls are compiled: past them the compiled elementwise ops' slower
# pass costs more than the dispatches saved (``ops/bench/results/cpu_fast.json``)
NORM_ELEMENTS = 2048
ROPE_ELEMENTS = 8192

_ORIGINAL = {"rms_norm": mx.fast.rms_norm, "layer_norm": mx.fast.layer_norm, "rope": mx.fast.rope}


def _rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    return _ORIGINAL["rms_norm"](x, weight, eps)


def _layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float) -> mx.array:
    return _ORIGINAL["layer_norm"](x, weight, bias, eps)


def _rope(a: mx.array, offset: mx.array, freqs: mx.array | None, dims: int, traditional: bool,
          base: float | None, scale: float) -> mx.array:
    return _ORIGINAL["rope"](a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)


# never dropped (see above); ``None`` and the settings are constants of each trace
COMPILED = {"rms_norm": mx.compile(_rms_norm), "layer_norm": mx.compile(_layer_norm), "rope": mx.compile(_rope)}


def _pays(x: mx.array, elements: int, stream) -> bool:
    """Whether compiling a call pays: on the CPU, on at most ``elements`` elements."""
    return stream is None and x.size <= elements and mx.default_device() == mx.cpu


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream=None) -> mx.array:
    if not _pays(x, NORM_ELEMENTS, stream):
        return _ORIGINAL["rms_norm"](x, weight, eps, stream=stream)
    return COMPILED["rms_norm"](x, weight, float(eps))


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float, *,
               stream=None) -> mx.array:
    if not _pays(x, NORM_ELEMENTS, stream):
        return _ORIGINAL["layer_norm"](x, weight, bias, eps, stream=stream)
    return COMPILED["layer_norm"](x, weight, bias, float(eps))


def rope(a: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float, offset,
         freqs: mx.array | None = None, stream=None) -> mx.array:
    if not (isinstance(offset, mx.array) and _pays(a, ROPE_ELEMENTS, stream)):
        return _ORIGINAL["rope"](a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs,
                                 stream=stream)
    return COMPILED["rope"](a, offset, freqs, int(dims), bool(traditional), None if base is None else float(base),
                            float(scale))


_installed = False


def install() -> None:
    """Put the compiled stand-ins in ``mx.fast`` (once; they defer to MLX's own off the CPU)."""
    global _installed
    if _installed:
        return
    mx.fast.rms_norm, mx.fast.layer_norm, mx.fast.rope = rms_norm, layer_norm, rope
    _installed = True
