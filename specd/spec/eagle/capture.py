"""Hidden-state capture from an mlx-lm model, without forking its model file.

The modules whose outputs EAGLE reads (the final norm for EAGLE-1, three
decoder layers for EAGLE-3) get a per-instance subclass whose ``__call__``
also keeps its output, so the model's own forward, weights, parameter names
and caches stay exactly as mlx-lm wrote them.  After any forward (prefill
chunk or verify step) ``take()`` returns what the last one produced.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class FeatureCapture:
    """Keeps the outputs of chosen modules of a target model, in order."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()):
        inner = model.model
        self.modules = [inner.layers[i] for i in feature_layers] if feature_layers else [inner.norm]
        self.outputs: list[mx.array | None] = [None] * len(self.modules)
        for slot, module in enumerate(self.modules):
            _hook(module, self, slot)

    def take(self) -> mx.array:
        """The captured features of the last forward, (B, N, H x modules)."""
        if any(o is None for o in self.outputs):
            raise RuntimeError("no forward has run since the last take()")
        out = self.outputs[0] if len(self.outputs) == 1 else mx.concatenate(self.outputs, axis=-1)
        self.outputs = [None] * len(self.modules)
        return out

    def remove(self) -> None:
        """Give the modules their own class back."""
        for module in self.modules:
            if type(module)._specd_capture is self:
                module.__class__ = type(module).__bases__[0]


def _hook(module: nn.Module, capture: FeatureCapture, slot: int) -> None:
    """Subclass the instance once; a later capture of the same module takes it over."""
    if "_specd_capture" not in type(module).__dict__:
        base = type(module)

        def __call__(self, *args, **kwargs):
            out = base.__call__(self, *args, **kwargs)
            hooked = type(self)
            hooked._specd_capture.outputs[hooked._specd_slot] = out
            return out

        module.__class__ = type(base.__name__, (base,), {"__call__": __call__, "_specd_capture": None,
                                                          "_specd_slot": 0})
    type(module)._specd_capture, type(module)._specd_slot = capture, slot
