"""The Model reconciler, split along its concerns (``reconciler`` ties the parts together)."""

from .reconciler import ModelReconciler

__all__ = ["ModelReconciler"]
