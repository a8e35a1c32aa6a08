"""The store: status writes and events queued off the caller's thread, acknowledged writes durable.

Real SQLite files under tmp_path.  The writer thread is held up the way a slow
disk or another writer would hold it: a second connection takes SQLite's write
lock (``BEGIN IMMEDIATE``), so nothing can commit until it lets go.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from specd.store import MAX_EVENTS_PER_OBJECT, Store

ROOT = Path(__file__).resolve().parents[2]


def item(kind: str, name: str, **spec) -> dict:
    return {"kind": kind, "name": name, "labels": {}, "annotations": {}, "spec": spec}


def on_disk(path: Path) -> tuple[dict[tuple[str, str], dict], list[tuple[str, str, str]]]:
    """What a fresh connection reads from the file: committed objects' statuses and events."""
    db = sqlite3.connect(str(path))
    try:
        statuses = {(k, n): json.loads(s) for k, n, s in db.execute("SELECT kind, name, status FROM objects")}
        events = list(db.execute("SELECT kind, name, message FROM events ORDER BY id"))
    finally:
        db.close()
    return statuses, events


@contextmanager
def writes_held(path: Path):
    """Nobody else can commit to ``path`` until the block ends."""
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        db.execute("ROLLBACK")
        db.close()


def test_status_and_events_return_before_their_commit_and_are_read_back_meanwhile(tmp_path):
    path = tmp_path / "specd.db"
    store = Store(path)
    store.apply([item("Model", "a", source="x")])
    with writes_held(path):
        started = time.monotonic()
        store.set_status("Model", "a", {"phase": "Loading"})
        store.record_event("Model", "a", "Normal", "Loading", "loading x")
        assert time.monotonic() - started < 1.0  # the writer waits on the lock (up to 10 s), not the caller
        # read your writes: on this thread and any other, while nothing of it is committed
        assert store.get("Model", "a").status == {"phase": "Loading"}
        assert store.find("Model", "a").status == {"phase": "Loading"}
        assert [o.status for o in store.list("Model")] == [{"phase": "Loading"}]
        assert [o.status for o in store.list()] == [{"phase": "Loading"}]
        assert [e["message"] for e in store.events("Model", "a")] == ["loading x"]
        seen = []
        thread = threading.Thread(target=lambda: seen.append((store.get("Model", "a").status,
                                                              store.events("Model", "a"))))
        thread.start()
        thread.join()
        assert seen[0][0] == {"phase": "Loading"} and seen[0][1][0]["reason"] == "Loading"
        statuses, events = on_disk(path)
        assert statuses[("Model", "a")] == {} and events == []  # queued, not yet committed
    store.flush()
    statuses, events = on_disk(path)
    assert statuses[("Model", "a")] == {"phase": "Loading"} and events == [("Model", "a", "loading x")]
    store.close()


def test_the_writer_commits_on_its_own_and_reads_stay_whole_throughout(tmp_path):
    """No flush: the writer thread commits; a reader looping meanwhile never sees an event twice,
    out of order, or a status older than the one written before it read."""
    path = tmp_path / "specd.db"
    store = Store(path)
    store.apply([item("Model", "a")])
    errors: list[str] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            messages = [int(e["message"]) for e in store.events("Model", "a")]
            if messages != sorted(set(messages)):
                errors.append(f"events {messages}")

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(300):
        store.set_status("Model", "a", {"n": i})
        store.record_event("Model", "a", "Normal", "Step", str(i))
        if store.get("Model", "a").status != {"n": i}:
            errors.append(f"status after {i}")
    stop.set()
    thread.join()
    assert not errors, errors[:5]
    assert [e["message"] for e in store.events("Model", "a")] == [str(i) for i in range(250, 300)]
    deadline = time.monotonic() + 10
    while on_disk(path)[0][("Model", "a")] != {"n": 299}:  # committed without anyone asking
        assert time.monotonic() < deadline, "the writer thread never committed"
        time.sleep(0.01)
    store.close()


def test_writes_are_committed_in_order_and_close_commits_what_is_queued(tmp_path):
    path = tmp_path / "specd.db"
    store = Store(path)
    store.apply([item("Model", "a"), item("Topology", "t")])
    for i in range(MAX_EVENTS_PER_OBJECT + 20):
        store.record_event("Model", "a", "Normal", "Step", f"a{i}")
        store.set_status("Model", "a", {"n": i})
        if i % 7 == 0:
            store.record_event("Topology", "t", "Normal", "Step", f"t{i}")
            store.set_status("Topology", "t", {"n": i})
    store.close()  # no flush: close commits the queue
    statuses, events = on_disk(path)
    last = MAX_EVENTS_PER_OBJECT + 19
    assert statuses == {("Model", "a"): {"n": last}, ("Topology", "t"): {"n": 63}}
    assert [m for k, _, m in events if k == "Model"] == [f"a{i}" for i in range(20, last + 1)]
    assert [m for k, _, m in events if k == "Topology"] == [f"t{i}" for i in range(0, last + 1, 7)]
    reopened = Store(path)
    assert reopened.get("Model", "a").status == {"n": last}
    assert len(reopened.events("Model", "a")) == MAX_EVENTS_PER_OBJECT
    reopened.close()


def test_an_unchanged_status_is_no_write_and_watchers_see_a_change_already_readable(tmp_path):
    path = tmp_path / "specd.db"
    store = Store(path)
    store.apply([item("Model", "a")])
    seen = []
    store.watch_status(lambda kind, name: seen.append((kind, name, store.get(kind, name).status)))
    with writes_held(path):
        store.set_status("Model", "a", {"phase": "Ready"})
        store.set_status("Model", "a", {"phase": "Ready"})  # the same as the queued one
        assert seen == [("Model", "a", {"phase": "Ready"})]
    store.flush()
    store.set_status("Model", "a", {"phase": "Ready"})  # the same as the committed one
    store.set_status("Model", "nobody", {"phase": "Ready"})  # no such object: nothing written
    assert len(seen) == 1
    assert store.find("Model", "nobody") is None
    store.close()
    assert on_disk(path)[0] == {("Model", "a"): {"phase": "Ready"}}


def test_a_status_queued_for_a_deleted_object_does_not_bring_it_back(tmp_path):
    path = tmp_path / "specd.db"
    store = Store(path)
    store.apply([item("Model", "a", source="old")])
    with writes_held(path):
        store.set_status("Model", "a", {"phase": "Ready", "of": "old"})
        done = threading.Event()

        def delete_and_recreate():  # waits for the lock, behind the queued status
            store.delete("Model", "a")
            assert store.find("Model", "a") is None
            store.set_status("Model", "a", {"phase": "Ready", "of": "deleted"})  # no object: no write
            store.apply([item("Model", "a", source="new")])
            done.set()

        thread = threading.Thread(target=delete_and_recreate)
        thread.start()
        time.sleep(0.2)
        assert not done.is_set()  # an acknowledged write waits for its commit
        assert store.get("Model", "a").status == {"phase": "Ready", "of": "old"}
    thread.join(10)
    assert done.is_set()
    fresh = store.get("Model", "a")
    assert fresh.spec == {"source": "new"} and fresh.status == {}  # the new object, not the old one's status
    store.set_status("Model", "a", {"phase": "Loading"})
    store.delete("Model", "a")
    store.set_status("Model", "a", {"phase": "Ready"})
    assert store.find("Model", "a") is None and store.list() == []
    store.close()
    assert on_disk(path)[0] == {}


def test_a_status_written_while_its_object_is_being_deleted_does_not_bring_it_back(tmp_path):
    path = tmp_path / "specd.db"
    store = Store(path)
    store.apply([item("Model", "a", source="old")])
    with writes_held(path):
        deleting = threading.Thread(target=store.delete, args=("Model", "a"))
        deleting.start()  # waits for the lock: the object is still there, and a reconciler reports on it
        time.sleep(0.2)
        store.set_status("Model", "a", {"phase": "Ready", "of": "old"})
        assert store.get("Model", "a").status == {"phase": "Ready", "of": "old"}
    deleting.join(10)
    assert store.find("Model", "a") is None and store.list("Model") == []
    store.apply([item("Model", "a", source="new")])  # a new object of the same name starts with no status
    assert store.get("Model", "a").status == {}
    store.flush()
    assert store.get("Model", "a").status == {}
    store.close()
    assert on_disk(path)[0] == {("Model", "a"): {}}


def test_an_apply_after_queued_statuses_keeps_them_and_its_own_changes(tmp_path):
    path = tmp_path / "specd.db"
    store = Store(path)
    store.apply([item("Model", "a", source="x")])
    store.set_status("Model", "a", {"observedGeneration": 1})
    [(obj, action)] = store.apply([{**item("Model", "a", source="y"), "labels": {"tier": "b"}}])
    assert action == "configured" and obj.generation == 2 and obj.status == {"observedGeneration": 1}
    assert store.get("Model", "a").labels == {"tier": "b"}
    statuses, _ = on_disk(path)  # the apply committed the status queued before it, in its transaction
    assert statuses[("Model", "a")] == {"observedGeneration": 1}
    store.close()


ACKNOWLEDGED = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from specd.store import Store

    Store.GATHER_SECONDS = 3600  # the writer thread commits nothing by itself: only the applies do
    store = Store(Path(sys.argv[1]))
    store.apply([{"kind": "Model", "name": "a", "labels": {}, "annotations": {}, "spec": {}}])
    store.set_status("Model", "a", {"phase": "Ready"})
    store.record_event("Model", "a", "Normal", "Ready", "ready")
    store.apply([{"kind": "Model", "name": "b", "labels": {}, "annotations": {}, "spec": {"n": 1}},
                 {"kind": "Topology", "name": "t", "labels": {}, "annotations": {}, "spec": {}}])
    print("acknowledged", flush=True)
    while True:  # a reconciler churning status until the kill
        store.set_status("Model", "b", {"t": time.monotonic()})
        store.record_event("Model", "b", "Normal", "Tick", "tick")
""")


def test_a_process_killed_after_an_acknowledged_apply_keeps_it(tmp_path):
    path = tmp_path / "specd.db"
    proc = subprocess.Popen([sys.executable, "-c", ACKNOWLEDGED, str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "acknowledged"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = Store(path)
    assert store.get("Model", "b").spec == {"n": 1} and store.find("Topology", "t") is not None
    # what was queued before the second apply was committed with it (the writer thread committed nothing):
    # a crash keeps the writes up to some point, in order
    assert store.get("Model", "a").status == {"phase": "Ready"}
    assert [e["reason"] for e in store.events("Model", "a")] == ["Ready"]
    assert store.get("Model", "b").status == {} and store.events("Model", "b") == []  # queued after: lost
    store.close()


def test_what_is_derived_from_a_kind_is_computed_again_only_when_one_of_them_changes(tmp_path):
    """``Store.derived``: a status write or an unchanged apply keeps the value; an apply that changes
    an object of the kind, a new one or a delete computes it again; other kinds do not touch it."""
    store = Store(tmp_path / "specd.db")
    calls: list[list[str]] = []

    def targets(objects):
        calls.append([o.name for o in objects])
        return {o.name: o.spec["targetRef"] for o in objects}

    try:
        store.apply([item("DraftPairing", "a", targetRef="m")])
        assert store.derived("DraftPairing", targets) == {"a": "m"} and len(calls) == 1
        store.set_status("DraftPairing", "a", {"observedGeneration": 1})
        store.apply([item("DraftPairing", "a", targetRef="m"), item("Model", "m", source="x")])
        assert store.derived("DraftPairing", targets) == {"a": "m"} and len(calls) == 1
        store.apply([item("DraftPairing", "a", targetRef="n")])
        assert store.derived("DraftPairing", targets) == {"a": "n"} and len(calls) == 2
        store.apply([item("DraftPairing", "b", targetRef="m")])
        assert store.derived("DraftPairing", targets) == {"a": "n", "b": "m"}
        store.delete("DraftPairing", "a")
        assert store.derived("DraftPairing", targets) == {"b": "m"} and calls[-1] == ["b"]
        assert store.names("DraftPairing") == ["b"] and store.names("Model") == ["m"]
        store.apply([item("DraftPairing", "a", targetRef="m")], dry_run=True)
        assert store.derived("DraftPairing", targets) == {"b": "m"} and len(calls) == 4
    finally:
        store.close()
