"""The SpecPolicy reconciler: which generating Models each policy selects and which it is applied to.

A Model takes the first policy, by name, whose selector matches its labels; the Model
reconciler applies it to the engine between steps, and this one reports on it.
"""

from __future__ import annotations

from ...api.manifest import SPEC_PARSERS
from ..conditions import condition
from ..manager import Result
from ..state import ModelState, Policy
from ...store import Store, StoredObject

KIND = "SpecPolicy"


def stored_policies(store: Store) -> list[Policy]:
    """Every SpecPolicy, by name: the order in which they are matched."""
    return store.derived(KIND, _policies)


def _policies(objects: list[StoredObject]) -> list[Policy]:
    return [Policy(o.name, o.generation, SPEC_PARSERS[KIND](o.spec)) for o in objects]


def policy_for(policies: list[Policy], labels: dict[str, str]) -> Policy | None:
    return next((p for p in policies if p.spec.selects(labels)), None)


def _runs(state: ModelState, policy: str) -> bool:
    """Whether every replica of the Model runs the policy: its engine here, if loaded, and each
    ready one on another Node (as its Node reports)."""
    applied, served = state.running.policy, state.serving
    here = [applied.name if applied else None] if served.engine is not None else []
    there = list(served.replica_set.replicas.policies().values()) if served.replica_set is not None else []
    return bool(here + there) and all(p == policy for p in here + there)


class SpecPolicyReconciler:
    kind = KIND

    def __init__(self, store: Store, states: dict[str, ModelState]):
        self.store, self.states = store, states  # states: the Model reconciler's

    def names(self) -> list[str]:
        return self.store.names(KIND)

    def reconcile(self, name: str) -> Result:
        obj = self.store.find(KIND, name)
        if obj is None:
            return Result()
        spec = SPEC_PARSERS[KIND](obj.spec)
        selected = sorted(m.name for m in self.store.list("Model")
                          if spec.selects(m.labels) and m.spec.get("task", "generate") == "generate")
        applied = sorted(n for n, s in self.states.items() if _runs(s, name))
        ok = applied == selected
        self.store.set_status(KIND, name, {
            "observedGeneration": obj.generation, "selectedModels": selected, "appliedModels": applied,
            "conditions": [condition("Ready", ok, "Applied" if ok else "Pending",
                                     f"applied to {len(applied)} of {len(selected)} selected models",
                                     obj.generation, obj.status)]})
        return Result()
