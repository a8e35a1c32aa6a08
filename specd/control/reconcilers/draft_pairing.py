"""The DraftPairing reconciler: which pairing each target takes, and how attaching it went.

A target takes one pairing, the oldest; later ones report a conflict. The drafter
itself is attached by the Model reconciler, since it is part of what the Model loads
and of its memory request; this reconciler reports on it.
"""

from __future__ import annotations

from typing import Any

from ...api.manifest import SPEC_PARSERS, DraftPairingSpec
from ..conditions import condition
from ..manager import Result
from ..state import ModelState, Pairing
from ...store import Store, StoredObject

KIND = "DraftPairing"


def chosen_pairings(store: Store) -> dict[str, Pairing]:
    """One pairing per target Model: the oldest wins."""
    return store.derived(KIND, _chosen)


def _chosen(pairings: list[StoredObject]) -> dict[str, Pairing]:
    chosen: dict[str, Pairing] = {}
    for obj in sorted(pairings, key=lambda o: (o.created, o.name)):
        spec: DraftPairingSpec = SPEC_PARSERS[KIND](obj.spec)
        chosen.setdefault(spec.target_ref, Pairing(obj.name, obj.generation, spec))
    return chosen


def _by_target(pairings: list[StoredObject]) -> dict[str, list[str]]:
    targets: dict[str, list[str]] = {}
    for obj in pairings:
        targets.setdefault(obj.spec.get("targetRef"), []).append(obj.name)
    return targets


class DraftPairingReconciler:
    kind = KIND

    def __init__(self, store: Store, states: dict[str, ModelState]):
        self.store, self.states = store, states  # states: the Model reconciler's

    def names(self) -> list[str]:
        return self.store.names(KIND)

    def targeting(self, model: str) -> list[str]:
        """The pairings whose target is ``model`` (they report on it)."""
        return list(self.store.derived(KIND, _by_target).get(model, ()))

    def reconcile(self, name: str) -> Result:
        obj = self.store.find(KIND, name)
        if obj is None:
            return Result()
        self.store.set_status(KIND, name, self._status(obj, chosen_pairings(self.store)))
        return Result()

    def _status(self, obj: StoredObject, by_target: dict[str, Pairing]) -> dict[str, Any]:
        spec: DraftPairingSpec = SPEC_PARSERS[KIND](obj.spec)
        state = self.states.get(spec.target_ref)
        applied = state.running.pairing if state is not None else None
        ours = applied is not None and applied.name == obj.name and applied.generation == obj.generation
        chosen = by_target.get(spec.target_ref)
        status: dict[str, Any] = {"observedGeneration": obj.generation}
        if chosen is not None and chosen.name != obj.name:
            ok, reason, message = False, "Conflict", f'Model "{spec.target_ref}" already has DraftPairing "{chosen.name}"'
        elif state is None:
            ok, reason, message = False, "TargetNotFound", f'Model "{spec.target_ref}" does not exist (yet)'
        elif state.running.spec.task == "embed":
            ok, reason = False, "TargetServesEmbeddings"
            message = f'Model "{spec.target_ref}" generates nothing to speculate on'
        elif state.serving.engine is None:
            ok, reason, message = False, "TargetNotReady", f'Model "{spec.target_ref}" is {state.serving.phase.value}'
        elif ours and state.running.pairing_error:  # this generation's outcome, never an older one's
            ok, reason, message = False, "DraftLoadFailed", state.running.pairing_error
        elif ours:
            ok, reason, message = True, "Attached", f"{spec.method} speculation for {spec.target_ref}"
            rate = state.serving.engine.speculation_status().get("acceptanceRate")
            if rate is not None:
                status["acceptanceRate"] = rate
        else:
            ok, reason, message = False, "Attaching", f"attaching to {spec.target_ref}"
        status["conditions"] = [condition("Ready", ok, reason, message, obj.generation, obj.status)]
        return status
