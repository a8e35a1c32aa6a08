"""Stored Responses (``store: true``), for ``previous_response_id`` and ``GET /v1/responses/{id}``.

One SQLite file in the state directory, beside the object store: each row is a
response as it was returned, with the whole conversation it answered (its own
input after its predecessors'), so continuing it needs one lookup.  Retention
is bounded by count and by age; the oldest go first.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

MAX_RESPONSES = 10_000
MAX_AGE_SECONDS = 30 * 24 * 3600

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    response TEXT NOT NULL,   -- the response object as returned
    conversation TEXT NOT NULL  -- every input item it answered, its predecessors' first
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


class ResponseStore:
    """Stored responses under ``path`` (":memory:" keeps them for the process only)."""

    def __init__(self, path: Path | str = ":memory:", max_responses: int = MAX_RESPONSES,
                 max_age_seconds: float = MAX_AGE_SECONDS):
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self.max_responses, self.max_age_seconds = max_responses, max_age_seconds

    def close(self) -> None:
        self._db.close()

    def put(self, response: dict[str, Any], conversation: list[dict]) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                             (response["id"], time.time(), json.dumps(response), json.dumps(conversation)))
            self._db.execute("DELETE FROM responses WHERE created < ?", (time.time() - self.max_age_seconds,))
            self._db.execute("DELETE FROM responses WHERE id NOT IN "
                             "(SELECT id FROM responses ORDER BY created DESC LIMIT ?)", (self.max_responses,))

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict]] | None:
        """The response and the conversation it answered, if still kept."""
        with self._lock:
            row = self._db.execute("SELECT response, conversation FROM responses WHERE id = ? AND created >= ?",
                                   (response_id, time.time() - self.max_age_seconds)).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
