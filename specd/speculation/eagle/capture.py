"""Hidden-state capture from an mlx-lm model, without forking its model file.

The modules whose outputs EAGLE reads (the final norm for EAGLE-1, three
decoder layers for EAGLE-3) are hooked (``hooks.hook``) to also keep their
outputs, so the model's own forward, weights, parameter names and caches
stay exactly as mlx-lm wrote them.  After any forward (prefill chunk or
verify step) ``take()`` returns what the last one produced.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..hooks import hook, unhook
from ...core.model_parts import decoder, final_norm


class FeatureCapture:
    """Keeps the outputs of chosen modules of a target model, in order."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()):
        self.modules = [decoder(model).layers[i] for i in feature_layers] if feature_layers else [final_norm(model)]
        self.outputs: list[mx.array | None] = [None] * len(self.modules)
        # one wrapper per module, kept: removing checks it is still the module's hook
        self._hooks = [partial(self._keep, slot) for slot in range(len(self.modules))]
        for module, around in zip(self.modules, self._hooks):
            hook(module, around)

    def _keep(self, slot: int, call: Callable[..., mx.array], *args, **kwargs) -> mx.array:
        """The module's output, kept in its slot."""
        out = call(*args, **kwargs)
        self.outputs[slot] = out
        return out

    def take(self) -> mx.array:
        """The captured features of the last forward, (B, N, H x modules)."""
        if any(o is None for o in self.outputs):
            raise RuntimeError("no forward has run since the last take()")
        out = self.outputs[0] if len(self.outputs) == 1 else mx.concatenate(self.outputs, axis=-1)
        self.outputs = [None] * len(self.modules)
        return out

    def remove(self) -> None:
        """Give the modules their own class back (those a later capture has not taken over)."""
        for module, around in zip(self.modules, self._hooks):
            unhook(module, around)
