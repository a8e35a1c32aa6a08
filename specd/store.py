"""Durable desired state: objects, their status and events, in SQLite (WAL).

Every acknowledged write (apply, delete) is committed with ``synchronous=FULL``
before the API answers, so a ``kill -9`` at any moment loses nothing
acknowledged and never leaves half an apply behind (a multi-object apply is one
transaction).  Optimistic concurrency follows Kubernetes: every change of
desired state bumps a global ``resourceVersion``; an update that names a stale
one is refused.

Status writes and events, which reconcilers make on the event loop and nobody
waits on, are not committed by their caller: they are queued and a writer
thread commits them in order, several to a transaction (``synchronous=FULL``
still), so no stream waits while SQLite syncs.  Until committed they are read
from memory (the queued status of an object, its queued events), so every read
sees every write made before it.  An acknowledged write first commits, in its
own transaction, whatever was queued before it: what a crash leaves is always
the writes up to some point, in the order they were made.
"""

from __future__ import annotations

import atexit
import json
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import structlog

from .api.manifest import SERVER_ANNOTATIONS

log = structlog.get_logger(__name__)

T = TypeVar("T")

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


@dataclass
class _Status:
    """A queued status write, for the object of ``uid`` (not a later one of the same name)."""
    kind: str
    name: str
    uid: str
    text: str


@dataclass
class _Event:
    """A queued event; ``row_id`` is its row once inserted (set before the commit)."""
    kind: str
    name: str
    row: tuple[str, str, str, str]  # type, reason, message, time
    row_id: int | None = None


def _row(row: tuple) -> StoredObject:
    """An ``objects`` row as the object it stores."""
    kind, name, uid, gen, rv, created, labels, annotations, spec, status = row
    return StoredObject(kind, name, uid, gen, rv, created, json.loads(labels), json.loads(annotations),
                        json.loads(spec), json.loads(status))


def _names(objects: list[StoredObject]) -> list[str]:
    return [o.name for o in objects]


def _values(o: StoredObject) -> tuple:
    """An object as its ``objects`` row."""
    return (o.kind, o.name, o.uid, o.generation, o.resource_version, o.created, json.dumps(o.labels),
            json.dumps(o.annotations), json.dumps(o.spec), json.dumps(o.status))


def _next_version(cur: sqlite3.Cursor) -> int:
    cur.execute("UPDATE counters SET value = value + 1 WHERE name='resourceVersion'")
    return cur.execute("SELECT value FROM counters WHERE name='resourceVersion'").fetchone()[0]


def _apply_one(cur: sqlite3.Cursor, obj: dict[str, Any], server: bool) -> tuple[StoredObject, str]:
    """One object of an apply, in its transaction: created, configured or unchanged (``Store.apply``)."""
    kind, name = obj["kind"], obj["name"]
    rows = cur.execute("SELECT * FROM objects WHERE kind=? AND name=?", (kind, name)).fetchall()
    current = _row(rows[0]) if rows else None
    if not server:
        kept = with_server_annotations(obj["annotations"], current.annotations if current else {})
        obj = {**obj, "annotations": kept}
    expected = obj.get("resourceVersion")
    if current is None:
        if expected:
            raise Conflict(f'{kind} "{name}" does not exist (resourceVersion {expected} given)')
        stored = StoredObject(kind, name, str(uuid.uuid4()), 1, _next_version(cur), now_iso(),
                              obj["labels"], obj["annotations"], obj["spec"], {})
        cur.execute("INSERT INTO objects VALUES (?,?,?,?,?,?,?,?,?,?)", _values(stored))
        return stored, "created"
    if expected and str(expected) != str(current.resource_version):
        raise Conflict(f'{kind} "{name}" was modified (resourceVersion {current.resource_version}, '
                       f"you sent {expected}); read it again and retry")
    if (current.spec, current.labels, current.annotations) == (obj["spec"], obj["labels"], obj["annotations"]):
        return current, "unchanged"
    if current.spec != obj["spec"]:
        current.generation += 1
    current.spec, current.labels, current.annotations = obj["spec"], obj["labels"], obj["annotations"]
    current.resource_version = _next_version(cur)
    cur.execute("UPDATE objects SET generation=?, resource_version=?, labels=?, annotations=?, spec=? "
                "WHERE kind=? AND name=?",
                (current.generation, current.resource_version, json.dumps(current.labels),
                 json.dumps(current.annotations), json.dumps(current.spec), kind, name))
    return current, "configured"


class Store:
    """Reads and acknowledged writes on the caller's thread; status and events by a writer thread.

    Two connections: ``_db`` reads (any thread, under ``_lock``), ``_wdb`` writes
    (only with ``_write_lock`` held: the writer thread's batches and the
    acknowledged writes, so these commit one at a time, in order).  ``_lock``
    guards the queue and the overlay of queued writes, and is held only for
    memory work and reads, never across a commit.
    """

    BATCH = 512  # queued writes committed together at most
    GATHER_SECONDS = 0.01  # how long the writer lets writes gather before it commits them (one sync for a burst)

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.directory = path.parent  # the daemon's state directory
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(SCHEMA)
        self._wdb = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._wdb.execute("PRAGMA synchronous=FULL")
        self._wdb.execute("PRAGMA busy_timeout=10000")
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: list[_Status | _Event] = []
        self._statuses: dict[tuple[str, str], _Status] = {}  # the latest queued status per object
        self._events: dict[tuple[str, str], list[_Event]] = {}  # queued events per object, in order
        self._closing = False
        self._closed = False
        self._watchers: list[Callable[[str, str], None]] = []
        self._status_watchers: list[Callable[[str, str], None]] = []
        self._kind_versions: dict[str, int] = {}  # moves when an object of the kind is applied or deleted
        self._derived: dict[tuple[str, Callable], tuple[int, Any]] = {}  # (kind, derive): (version, value)
        self._writer = threading.Thread(target=self._write_queued, name="store-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # a store left open still commits what it queued

    def close(self) -> None:
        """Commit what is queued, stop the writer thread and close the database."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake.notify_all()
        self._writer.join()
        try:
            self.flush()
        except sqlite3.Error:
            log.exception("store: queued status and events lost at close", writes=len(self._queue))
        atexit.unregister(self.close)
        with self._write_lock, self._lock:
            self._closed = True
            self._db.close()
            self._wdb.close()

    def flush(self) -> None:
        """Commit every status write and event queued so far (the writer thread does it anyway)."""
        with self._write_lock:
            self._commit_queued()

    def watch(self, callback: Callable[[str, str], None]) -> None:
        """``callback(kind, name)`` after every committed change to an object."""
        self._watchers.append(callback)

    def watch_status(self, callback: Callable[[str, str], None]) -> None:
        """``callback(kind, name)`` after an object's status changed (readers see the new one)."""
        self._status_watchers.append(callback)

    def _notify(self, changed: list[tuple[str, str]]) -> None:
        with self._lock:
            for kind in {kind for kind, _ in changed}:
                self._kind_versions[kind] = self._kind_versions.get(kind, 0) + 1
        for kind, name in changed:
            for callback in self._watchers:
                callback(kind, name)

    # ------------------------------------------------------------------ reads

    def _current(self, row: tuple) -> tuple:
        """A stored row with its queued status, if one is queued for this very object (``_lock`` held)."""
        queued = self._statuses.get((row[0], row[1]))
        return row if queued is None or queued.uid != row[2] else (*row[:9], queued.text)

    def get(self, kind: str, name: str) -> StoredObject:
        with self._lock:
            rows = self._db.execute("SELECT * FROM objects WHERE kind=? AND name=?", (kind, name)).fetchall()
            row = self._current(rows[0]) if rows else None
        if row is None:
            raise NotFound(f'{kind} "{name}" not found')
        return _row(row)

    def find(self, kind: str, name: str) -> StoredObject | None:
        try:
            return self.get(kind, name)
        except NotFound:
            return None

    def names(self, kind: str) -> list[str]:
        return list(self.derived(kind, _names))

    def derived(self, kind: str, derive: Callable[[list[StoredObject]], T]) -> T:
        """``derive(self.list(kind))``, computed again only after an object of ``kind`` was
        applied or deleted: the reconcilers ask for these (a Model's pairing, the policies, the
        names) at every look, and a burst of applies would read the same rows hundreds of times.
        For what follows from specs and metadata only: a status write does not move it. The
        value is shared by every caller: not to be changed. It is kept per ``derive``, so that
        is a module's function, never a lambda made per call."""
        with self._lock:
            version = self._kind_versions.get(kind, 0)
            cached = self._derived.get((kind, derive))
        if cached is not None and cached[0] == version:
            return cached[1]
        value = derive(self.list(kind))  # a change meanwhile moved the version: computed again next time
        with self._lock:
            self._derived[(kind, derive)] = (version, value)
        return value

    def list(self, kind: str | None = None) -> list[StoredObject]:
        with self._lock:
            if kind is None:
                rows = self._db.execute("SELECT * FROM objects ORDER BY kind, name").fetchall()
            else:
                rows = self._db.execute("SELECT * FROM objects WHERE kind=? ORDER BY name", (kind,)).fetchall()
            rows = [self._current(r) for r in rows]
        return [_row(r) for r in rows]

    def events(self, kind: str, name: str) -> list[dict[str, str]]:
        with self._lock:
            rows = self._db.execute("SELECT id, type, reason, message, time FROM events WHERE kind=? AND name=? "
                                    "ORDER BY id", (kind, name)).fetchall()
            # a queued event whose row is committed (ids grow; an in-flight batch's are above every
            # committed one) is read from its row, or not at all if trimmed: it is not read twice
            last = rows[-1][0] if rows else 0
            queued = [e.row for e in self._events.get((kind, name), ()) if e.row_id is None or e.row_id > last]
        rows = ([row[1:] for row in rows] + queued)[-MAX_EVENTS_PER_OBJECT:]
        return [{"type": t, "reason": r, "message": m, "time": ts} for t, r, m, ts in rows]

    # ------------------------------------------- acknowledged writes (committed before they return)

    def _transaction(self, write: Callable[[sqlite3.Cursor], Any], keep: bool = True) -> Any:
        """``write(cur)`` committed, after the queued writes, in one transaction; with ``keep``
        false (a dry run) or when ``write`` raises, only the queued writes are committed."""
        with self._write_lock:
            with self._lock:
                if self._closed:
                    raise sqlite3.ProgrammingError("the store is closed")
                batch, self._queue = self._queue, []
            cur = self._wdb.cursor()
            try:
                cur.execute("BEGIN IMMEDIATE")
                self._write_batch(cur, batch)
                cur.execute("SAVEPOINT acknowledged")
            except BaseException:
                self._failed(cur, batch)
                raise
            try:
                result = write(cur)
            except BaseException:
                self._end(cur, batch, keep=False)
                raise
            self._end(cur, batch, keep)
            return result

    def _end(self, cur: sqlite3.Cursor, batch: list[_Status | _Event], keep: bool) -> None:
        try:
            if not keep:
                cur.execute("ROLLBACK TO acknowledged")
            cur.execute("RELEASE acknowledged")
            cur.execute("COMMIT")
        except BaseException:
            self._failed(cur, batch)
            raise
        self._committed(batch)

    def apply(self, objects: list[dict[str, Any]], dry_run: bool = False,
              server: bool = False) -> list[tuple[StoredObject, str]]:
        """Create or update objects in one transaction: all of them or none.

        Each item has kind, name, labels, annotations, spec and optionally the
        resourceVersion the client last read.  The generation moves only when
        the spec changes; a write that changes nothing is not a write.  Only the
        daemon's own writes (``server``) touch ``SERVER_ANNOTATIONS``: a client's
        keep the stored ones, so applying a watched file by hand is a no-op.
        """
        results: list[tuple[StoredObject, str]] = self._transaction(
            lambda cur: [_apply_one(cur, obj, server) for obj in objects], keep=not dry_run)
        with self._lock:  # a status queued meanwhile (by another thread) is the current one
            for obj, _ in results:
                queued = self._statuses.get((obj.kind, obj.name))
                if queued is not None and queued.uid == obj.uid:
                    obj.status = json.loads(queued.text)
        if not dry_run:
            self._notify([(o.kind, o.name) for o, action in results if action != "unchanged"])
        return results



    def delete(self, kind: str, name: str, dry_run: bool = False) -> StoredObject:
        def delete_one(cur: sqlite3.Cursor) -> StoredObject:
            rows = cur.execute("SELECT * FROM objects WHERE kind=? AND name=?", (kind, name)).fetchall()
            if not rows:
                raise NotFound(f'{kind} "{name}" not found')
            cur.execute("DELETE FROM objects WHERE kind=? AND name=?", (kind, name))
            return _row(rows[0])

        obj = self._transaction(delete_one, keep=not dry_run)
        if not dry_run:
            self._notify([(kind, name)])
        return obj

    # ------------------------------------------- status and events (queued, committed by the writer)

    def set_status(self, kind: str, name: str, status: dict[str, Any]) -> None:
        """Write an object's observed status.  Not a change of desired state:
        neither the generation nor the resourceVersion moves, so a manifest
        read with ``get -o yaml`` applies back cleanly while status churns.

        Returns at once: the write is queued (readers see it from now on) and
        committed by the writer thread.  A status equal to the current one, or
        for an object that does not exist, is no write."""
        text = json.dumps(status)
        key = (kind, name)
        with self._lock:
            rows = self._db.execute("SELECT uid, status FROM objects WHERE kind=? AND name=?", key).fetchall()
            if not rows:
                return
            uid, current = rows[0]
            queued = self._statuses.get(key)
            if queued is not None and queued.uid == uid:
                current = queued.text
            if current == text:
                return
            write = self._statuses[key] = _Status(kind, name, uid, text)
            self._enqueue(write)
        for callback in self._status_watchers:
            callback(kind, name)

    def record_event(self, kind: str, name: str, type_: str, reason: str, message: str) -> None:
        """Append an event to an object's (the last ``MAX_EVENTS_PER_OBJECT`` are kept); returns at once."""
        with self._lock:
            event = _Event(kind, name, (type_, reason, message, now_iso()))
            self._events.setdefault((kind, name), []).append(event)
            self._enqueue(event)

    def _enqueue(self, write: _Status | _Event) -> None:
        """(``_lock`` held.)"""
        if self._closed:
            raise sqlite3.ProgrammingError("the store is closed")
        self._queue.append(write)
        if len(self._queue) == 1:
            self._wake.notify()

    def _write_queued(self) -> None:
        """The writer thread: commit what is queued, batch after batch, until closed."""
        failures = 0
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                # a reconcile's status and events, a burst of reconciles: one sync
                if self._wake.wait_for(lambda: self._closing, self.GATHER_SECONDS):
                    return  # close() commits the rest itself
            try:
                with self._write_lock:
                    self._commit_queued(self.BATCH)
                failures = 0
            except Exception:
                failures += 1
                log.exception("store: committing status and events failed; retrying", failures=failures)
                with self._lock:
                    self._wake.wait_for(lambda: self._closing, min(5.0, 0.05 * 2 ** failures))

    def _commit_queued(self, most: int | None = None) -> None:
        """Commit up to ``most`` queued writes (all by default), oldest first (``_write_lock`` held)."""
        while True:
            with self._lock:
                if self._closed:
                    return
                batch = self._queue[:most] if most is not None else self._queue
                self._queue = self._queue[len(batch):]
            if not batch:
                return
            cur = self._wdb.cursor()
            try:
                cur.execute("BEGIN IMMEDIATE")
                self._write_batch(cur, batch)
                cur.execute("COMMIT")
            except BaseException:
                self._failed(cur, batch)
                raise
            self._committed(batch)
            if most is not None:
                return

    def _write_batch(self, cur: sqlite3.Cursor, batch: list[_Status | _Event]) -> None:
        """The queued writes into the open transaction: each object's last status (earlier ones are
        overwritten anyway: statuses and events are apart, and a batch holds no other writes), then
        the events in order, each object's trimmed once."""
        statuses: dict[tuple[str, str], _Status] = {}
        events: list[_Event] = []
        for write in batch:
            if isinstance(write, _Status):
                statuses[(write.kind, write.name)] = write
            else:
                events.append(write)
        for s in statuses.values():  # the object it was for: one deleted meanwhile stays deleted
            cur.execute("UPDATE objects SET status=? WHERE kind=? AND name=? AND uid=?",
                        (s.text, s.kind, s.name, s.uid))
        for e in events:
            cur.execute("INSERT INTO events (kind, name, type, reason, message, time) VALUES (?,?,?,?,?,?)",
                        (e.kind, e.name, *e.row))
            with self._lock:  # before the commit: a reader that sees the row knows it is this event
                e.row_id = cur.lastrowid
        for kind, name in dict.fromkeys((e.kind, e.name) for e in events):
            cur.execute("DELETE FROM events WHERE kind=? AND name=? AND id NOT IN "
                        "(SELECT id FROM events WHERE kind=? AND name=? ORDER BY id DESC LIMIT ?)",
                        (kind, name, kind, name, MAX_EVENTS_PER_OBJECT))

    def _committed(self, batch: list[_Status | _Event]) -> None:
        """Queued writes now read from the database (unless a later status was queued meanwhile)."""
        with self._lock:
            for write in batch:
                key = (write.kind, write.name)
                if isinstance(write, _Status):
                    if self._statuses.get(key) is write:
                        del self._statuses[key]
                else:
                    queued = self._events[key]
                    queued.remove(write)
                    if not queued:
                        del self._events[key]

    def _failed(self, cur: sqlite3.Cursor, batch: list[_Status | _Event]) -> None:
        """A transaction that did not commit: its queued writes go back to the head of the queue."""
        try:
            if self._wdb.in_transaction:
                cur.execute("ROLLBACK")
        except sqlite3.Error:
            log.exception("store: rollback failed")
        with self._lock:
            for write in batch:
                if isinstance(write, _Event):
                    write.row_id = None
            self._queue[:0] = batch
