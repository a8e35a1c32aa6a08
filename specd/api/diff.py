"""What ``apply`` would change in a stored object, as a unified diff: ``specd diff`` prints it,
and the admin API's dry run returns it (the console shows it before applying)."""

from __future__ import annotations

import difflib
from typing import Any

import yaml

from .manifest import SERVER_ANNOTATIONS


def comparable(obj: dict[str, Any] | None) -> str:
    """What apply would write, as YAML: name, labels, annotations (less the server's own) and
    spec; None (nothing stored) is empty."""
    if obj is None:
        return ""
    meta = dict(obj.get("metadata", {}))
    meta["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in SERVER_ANNOTATIONS}
    view = {"metadata": {k: meta[k] for k in ("name", "labels", "annotations") if meta.get(k)},
            "spec": obj.get("spec")}
    return yaml.safe_dump(view, sort_keys=True)


def manifest_diff(live: dict[str, Any] | None, wanted: dict[str, Any], kind: str, name: str) -> str:
    """The unified diff from the stored object (``live``; None: none) to ``wanted``; empty
    when apply would change nothing."""
    return "".join(difflib.unified_diff(comparable(live).splitlines(True), comparable(wanted).splitlines(True),
                                        f"live/{kind}/{name}", f"merged/{kind}/{name}"))
