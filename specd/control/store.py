"""Durable desired state: objects, their status and events, in SQLite (WAL).

Every acknowledged write is committed with ``synchronous=FULL`` before the
API answers, so a ``kill -9`` at any moment loses nothing acknowledged and
never leaves half an apply behind (a multi-object apply is one transaction).
Optimistic concurrency follows Kubernetes: every change of desired state
bumps a global ``resourceVersion``; an update that names a stale one is refused.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..api.manifest import SERVER_ANNOTATIONS

SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    uid TEXT NOT NULL,
    generation INTEGER NOT NULL,
    resource_version INTEGER NOT NULL,
    created TEXT NOT NULL,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    PRIMARY KEY (kind, name)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    type TEXT NOT NULL,
    reason TEXT NOT NULL,
    message TEXT NOT NULL,
    time TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters VALUES ('resourceVersion', 0);
"""
MAX_EVENTS_PER_OBJECT = 50


class Conflict(Exception):
    """The object changed since the version the client read (HTTP 409)."""


class NotFound(KeyError):
    pass


def with_server_annotations(sent: dict[str, str], stored: dict[str, str]) -> dict[str, str]:
    """A client's annotations with the server's own as stored (a client's values for those are dropped)."""
    mine = {k: v for k, v in sent.items() if k not in SERVER_ANNOTATIONS}
    return {**mine, **{k: v for k, v in stored.items() if k in SERVER_ANNOTATIONS}}


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class StoredObject:
    kind: str
    name: str
    uid: str
    generation: int
    resource_version: int
    created: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    status: dict[str, Any] = field(default_factory=dict)

    def manifest(self, api_version: str) -> dict[str, Any]:
        """The object as the API and ``get -o yaml`` show it."""
        metadata: dict[str, Any] = {"name": self.name}
        if self.labels:
            metadata["labels"] = self.labels
        if self.annotations:
            metadata["annotations"] = self.annotations
        metadata.update(uid=self.uid, generation=self.generation,
                        resourceVersion=str(self.resource_version), creationTimestamp=self.created)
        return {"apiVersion": api_version, "kind": self.kind, "metadata": metadata,
                "spec": self.spec, "status": self.status}


class Store:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self._watchers: list[Callable[[str, str], None]] = []
        self._status_watchers: list[Callable[[str, str], None]] = []

    def close(self) -> None:
        self._db.close()

    def watch(self, callback: Callable[[str, str], None]) -> None:
        """``callback(kind, name)`` after every committed change to an object."""
        self._watchers.append(callback)

    def watch_status(self, callback: Callable[[str, str], None]) -> None:
        """``callback(kind, name)`` after an object's status changed."""
        self._status_watchers.append(callback)

    def _notify(self, changed: list[tuple[str, str]]) -> None:
        for kind, name in changed:
            for callback in self._watchers:
                callback(kind, name)

    @staticmethod
    def _row(row: tuple) -> StoredObject:
        kind, name, uid, gen, rv, created, labels, annotations, spec, status = row
        return StoredObject(kind, name, uid, gen, rv, created, json.loads(labels), json.loads(annotations),
                            json.loads(spec), json.loads(status))

    def get(self, kind: str, name: str) -> StoredObject:
        row = self._db.execute("SELECT * FROM objects WHERE kind=? AND name=?", (kind, name)).fetchone()
        if row is None:
            raise NotFound(f'{kind} "{name}" not found')
        return self._row(row)

    def find(self, kind: str, name: str) -> StoredObject | None:
        try:
            return self.get(kind, name)
        except NotFound:
            return None

    def names(self, kind: str) -> list[str]:
        return [name for (name,) in self._db.execute("SELECT name FROM objects WHERE kind=? ORDER BY name", (kind,))]

    def list(self, kind: str | None = None) -> list[StoredObject]:
        if kind is None:
            rows = self._db.execute("SELECT * FROM objects ORDER BY kind, name").fetchall()
        else:
            rows = self._db.execute("SELECT * FROM objects WHERE kind=? ORDER BY name", (kind,)).fetchall()
        return [self._row(r) for r in rows]

    def apply(self, objects: list[dict[str, Any]], dry_run: bool = False,
              server: bool = False) -> list[tuple[StoredObject, str]]:
        """Create or update objects in one transaction: all of them or none.

        Each item has kind, name, labels, annotations, spec and optionally the
        resourceVersion the client last read.  The generation moves only when
        the spec changes; a write that changes nothing is not a write.  Only the
        daemon's own writes (``server``) touch ``SERVER_ANNOTATIONS``: a client's
        keep the stored ones, so applying a watched file by hand is a no-op.
        """
        results: list[tuple[StoredObject, str]] = []
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                for obj in objects:
                    results.append(self._apply_one(cur, obj, server))
                if dry_run:
                    cur.execute("ROLLBACK")
                else:
                    cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
        if not dry_run:
            self._notify([(o.kind, o.name) for o, action in results if action != "unchanged"])
        return results

    def _next_version(self, cur: sqlite3.Cursor) -> int:
        cur.execute("UPDATE counters SET value = value + 1 WHERE name='resourceVersion'")
        return cur.execute("SELECT value FROM counters WHERE name='resourceVersion'").fetchone()[0]

    def _apply_one(self, cur: sqlite3.Cursor, obj: dict[str, Any], server: bool) -> tuple[StoredObject, str]:
        kind, name = obj["kind"], obj["name"]
        row = cur.execute("SELECT * FROM objects WHERE kind=? AND name=?", (kind, name)).fetchone()
        current = self._row(row) if row is not None else None
        if not server:
            kept = with_server_annotations(obj["annotations"], current.annotations if current else {})
            obj = {**obj, "annotations": kept}
        expected = obj.get("resourceVersion")
        if current is None:
            if expected:
                raise Conflict(f'{kind} "{name}" does not exist (resourceVersion {expected} given)')
            stored = StoredObject(kind, name, str(uuid.uuid4()), 1, self._next_version(cur), now_iso(),
                                  obj["labels"], obj["annotations"], obj["spec"], {})
            cur.execute("INSERT INTO objects VALUES (?,?,?,?,?,?,?,?,?,?)", self._values(stored))
            return stored, "created"
        if expected and str(expected) != str(current.resource_version):
            raise Conflict(f'{kind} "{name}" was modified (resourceVersion {current.resource_version}, '
                           f"you sent {expected}); read it again and retry")
        if (current.spec, current.labels, current.annotations) == (obj["spec"], obj["labels"], obj["annotations"]):
            return current, "unchanged"
        if current.spec != obj["spec"]:
            current.generation += 1
        current.spec, current.labels, current.annotations = obj["spec"], obj["labels"], obj["annotations"]
        current.resource_version = self._next_version(cur)
        cur.execute("UPDATE objects SET generation=?, resource_version=?, labels=?, annotations=?, spec=? "
                    "WHERE kind=? AND name=?",
                    (current.generation, current.resource_version, json.dumps(current.labels),
                     json.dumps(current.annotations), json.dumps(current.spec), kind, name))
        return current, "configured"

    @staticmethod
    def _values(o: StoredObject) -> tuple:
        return (o.kind, o.name, o.uid, o.generation, o.resource_version, o.created, json.dumps(o.labels),
                json.dumps(o.annotations), json.dumps(o.spec), json.dumps(o.status))

    def delete(self, kind: str, name: str, dry_run: bool = False) -> StoredObject:
        with self._lock:
            obj = self.get(kind, name)
            if not dry_run:
                self._db.execute("DELETE FROM objects WHERE kind=? AND name=?", (kind, name))
        if not dry_run:
            self._notify([(kind, name)])
        return obj

    def set_status(self, kind: str, name: str, status: dict[str, Any]) -> None:
        """Write an object's observed status.  Not a change of desired state:
        neither the generation nor the resourceVersion moves, so a manifest
        read with ``get -o yaml`` applies back cleanly while status churns."""
        text = json.dumps(status)
        with self._lock:
            changed = self._db.execute("UPDATE objects SET status=? WHERE kind=? AND name=? AND status != ?",
                                       (text, kind, name, text)).rowcount
        if changed:
            for callback in self._status_watchers:
                callback(kind, name)

    def record_event(self, kind: str, name: str, type_: str, reason: str, message: str) -> None:
        with self._lock:
            self._db.execute("INSERT INTO events (kind, name, type, reason, message, time) VALUES (?,?,?,?,?,?)",
                             (kind, name, type_, reason, message, now_iso()))
            self._db.execute(
                "DELETE FROM events WHERE kind=? AND name=? AND id NOT IN "
                "(SELECT id FROM events WHERE kind=? AND name=? ORDER BY id DESC LIMIT ?)",
                (kind, name, kind, name, MAX_EVENTS_PER_OBJECT))

    def events(self, kind: str, name: str) -> list[dict[str, str]]:
        rows = self._db.execute("SELECT type, reason, message, time FROM events WHERE kind=? AND name=? "
                                "ORDER BY id", (kind, name)).fetchall()
        return [{"type": t, "reason": r, "message": m, "time": ts} for t, r, m, ts in rows]
