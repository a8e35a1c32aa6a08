"""Status conditions, as Kubernetes objects carry them."""

from __future__ import annotations

from typing import Any

from ..store import now_iso


def condition(type_: str, ok: bool, reason: str, message: str, generation: int,
              previous: dict[str, Any]) -> dict[str, Any]:
    """A status condition; lastTransitionTime moves only when the status flips."""
    status = "True" if ok else "False"
    old = next((c for c in previous.get("conditions", []) if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now_iso()
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}
