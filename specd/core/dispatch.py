"""Each decoder layer handed to MLX's CPU stream as soon as its graph is built.

An engine's forward is built whole by the host and then evaluated. MLX's ``eval`` (and
``async_eval``) hands a graph's ops to the stream a bounded number ahead of those done
(``MAX_ACTIVE_TASKS`` tasks of ``DISPATCHES_PER_TASK`` ops, ``mlx/transforms.cpp``,
``mlx/backend/cpu/encoder.h``): the device waits while the host builds the whole graph, then
the host waits while the device runs it, step after step, speculating or not. With each layer's
output started as soon as the layer is built (``mx.async_eval``), the device runs layer i while
the host builds layer i + 1; the ops and their order are the same, so are the numbers.

``install`` gives each decoder layer of a model that ``loader.load_model`` loads a subclass of its
own class (as ``speculation.hooks`` does, and before any hook: a hook then subclasses it, and
unhooking gives it back) whose call starts its output, on the CPU, within ``forwards``: a decode
step's forwards (the model runner's plain and verify forwards, a draft model's steps), never a
prefill chunk's (built whole, its first token came later: ``ops/bench/layer_dispatch.py``), nor
a function transformation's (``mx.compile``, ``mx.grad`` cannot evaluate mid-trace), nor anything
else that calls the model. Measured on MLX's CPU backend; on a GPU, unmeasured, layers are left
as they are.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .model_parts import decoder

_STATE = threading.local()  # per engine thread: whether a decode step's forward is being built


@contextmanager
def forwards() -> Iterator[None]:
    """Within: the installed layers start their outputs as they are built (a decode step's forwards)."""
    before = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before


def install(model: nn.Module) -> None:
    """On MLX's CPU backend, make each of ``model``'s decoder layers start its output within ``forwards``."""
    if mx.default_device() != mx.cpu:
        return
    try:
        layers = decoder(model).layers
    except ValueError:  # no decoder stack where mlx-lm's families keep one: left as it is
        return
    for layer in layers:
        if isinstance(layer, nn.Module) and not getattr(type(layer), "_specd_dispatches", False):
            layer.__class__ = _dispatching(type(layer))


@functools.cache
def _dispatching(base: type) -> type:
    """``base`` whose call starts its output within ``forwards`` (one subclass per class)."""

    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        if getattr(_STATE, "on", False):
            mx.async_eval(out)
        return out

    return type(base.__name__, (base,), {"__call__": __call__, "_specd_dispatches": True,
                                         "__module__": base.__module__})
