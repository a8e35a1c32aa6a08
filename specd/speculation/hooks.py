"""Per-instance call hooks on mlx-lm modules, without forking their model files.

A hooked module gets a subclass of its own whose ``__call__`` goes through a
wrapper, so the model's forward, weights, parameter names and caches stay
exactly as mlx-lm wrote them, and other instances of the class are untouched.
A module is subclassed once: hooking it again (a later capture of the same
model, say) only swaps the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import mlx.nn as nn

# Called as ``around(call, *args, **kwargs)`` in place of the module, ``call``
# being the module's own ``__call__`` bound to it.
Around = Callable[..., Any]


def hook(module: nn.Module, around: Around) -> None:
    """Route the module's calls through ``around``."""
    if "_specd_around" not in type(module).__dict__:
        base = type(module)

        def __call__(self, *args, **kwargs):
            return type(self)._specd_around(MethodType(base.__call__, self), *args, **kwargs)

        module.__class__ = type(base.__name__, (base,), {"__call__": __call__, "_specd_around": None})
    type(module)._specd_around = around


def unhook(module: nn.Module, around: Around) -> None:
    """Give the module its own class back, unless a later hook took it over."""
    if type(module).__dict__.get("_specd_around") is around:
        module.__class__ = type(module).__bases__[0]
