"""The control plane's manager: one reconciler per kind, each looked at when its objects
change, when a watch maps another kind's change to it, and when it asked to be looked
at again (``Result.requeue_after``); a reconcile that raises is retried with backoff.

The reconcilers here record what they are asked and write status to a real store;
the daemon's own reconcilers are tested through the daemon (test_control_plane,
test_memory_scheduling, test_cluster)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specd.control import manager as manager_module
from specd.control.manager import Manager, Result
from specd.store import Store


class Recording:
    """Writes a status for each look, counting them; ``results`` says when to look again."""

    def __init__(self, kind: str, store: Store):
        self.kind, self.store = kind, store
        self.looks: list[str] = []
        self.results: dict[str, list] = {}  # name -> what the next looks return (or raise)

    def names(self) -> list[str]:
        return [o.name for o in self.store.list(self.kind)]

    def reconcile(self, name: str) -> Result:
        self.looks.append(name)
        self.store.set_status(self.kind, name, {"looks": self.looks.count(name)})
        planned = self.results.get(name)
        outcome = planned.pop(0) if planned else Result()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@pytest.fixture(autouse=True)
def no_resync(monkeypatch):
    """Only what the tests ask for is looked at (a resync would look at everything)."""
    monkeypatch.setattr(manager_module, "RESYNC_SECONDS", 3600.0)


def objects(*pairs: tuple[str, str, dict]) -> list[dict]:
    return [{"kind": kind, "name": name, "labels": {}, "annotations": {}, "spec": spec} for kind, name, spec in pairs]


async def settle(until, timeout: float = 30.0) -> None:
    """Wait (with the manager running) until ``until()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not until():
        assert loop.time() < deadline, "the manager never got there"
        await asyncio.sleep(0.01)


async def running(manager: Manager, scenario):
    task = asyncio.create_task(manager.run())
    try:
        return await scenario()
    finally:
        task.cancel()


def test_changes_and_watches_queue_the_right_objects_once(tmp_path: Path):
    store = Store(tmp_path / "specd.db")
    store.apply(objects(("Model", "a", {}), ("Model", "b", {}), ("DraftPairing", "p", {"targetRef": "a"})))
    models, pairings = Recording("Model", store), Recording("DraftPairing", store)
    manager = Manager(store)
    manager.add(models)
    manager.add(pairings)
    manager.watch("DraftPairing", "Model", lambda name: [store.get("DraftPairing", name).spec["targetRef"]])
    manager.watch("Model", "DraftPairing", lambda name: ["p"] if name == "a" else [], status=True)

    async def scenario():
        await settle(lambda: sorted(models.looks) == ["a", "b"] and pairings.looks)
        start_models, start_pairings = len(models.looks), len(pairings.looks)
        # a pairing's change is its own and its target's, not the other Model's
        store.apply(objects(("DraftPairing", "p", {"targetRef": "a", "source": "x"})))
        for _ in range(5):  # asked for often, looked at once
            manager.enqueue("Model", "a")
        await settle(lambda: len(models.looks) > start_models and len(pairings.looks) > start_pairings)
        return models.looks[start_models:], pairings.looks[start_pairings:]

    later_models, later_pairings = asyncio.run(running(manager, scenario))
    assert later_models == ["a"]  # one look for six requests; "b" was not asked for
    # "p" was looked at for its own change and for each status change of "a", which its looks write;
    # its own status writes queue nothing (no loop)
    assert set(later_pairings) == {"p"} and len(later_pairings) <= 3
    assert store.get("Model", "b").status == {"looks": 1}


def test_requeue_after_and_backoff_on_failure(tmp_path: Path):
    store = Store(tmp_path / "specd.db")
    store.apply(objects(("Topology", "t", {}), ("Topology", "u", {})))
    topologies = Recording("Topology", store)
    # "t" asks to be looked at again twice, then is done; "u" fails twice, then succeeds
    topologies.results = {"t": [Result(0.05), Result(0.05), Result()],
                          "u": [RuntimeError("first"), RuntimeError("second"), Result()]}
    manager = Manager(store)
    manager.add(topologies)

    async def scenario():
        await settle(lambda: topologies.looks.count("t") == 3 and topologies.looks.count("u") == 3)
        await asyncio.sleep(0.3)  # nothing more is due: the last looks asked for none
        return list(topologies.looks)

    looks = asyncio.run(running(manager, scenario))
    assert looks.count("t") == 3 and looks.count("u") == 3
    assert store.get("Topology", "u").status == {"looks": 3}


def test_resync_runs_while_heartbeats_flow(tmp_path: Path, monkeypatch):
    """A head's Nodes heartbeat every 2 s, more often than the resync interval: the resync
    still runs on its clock, so an object no event names (an event that was missed) is looked at."""
    monkeypatch.setattr(manager_module, "RESYNC_SECONDS", 0.3)
    store = Store(tmp_path / "specd.db")
    store.apply(objects(("Model", "quiet", {}), ("Topology", "busy", {})))
    models, nodes = Recording("Model", store), Recording("Topology", store)
    manager = Manager(store)
    manager.add(models)
    manager.add(nodes)

    async def heartbeats(stop: asyncio.Event) -> None:
        while not stop.is_set():  # an event every 20 ms, a tenth of the resync interval and less
            manager.enqueue("Topology", "busy")
            await asyncio.sleep(0.02)

    async def scenario():
        stop = asyncio.Event()
        beating = asyncio.create_task(heartbeats(stop))
        await settle(lambda: models.looks.count("quiet") >= 4)
        stop.set()
        await beating
        return manager.resyncs, nodes.looks.count("busy")

    resyncs, busy = asyncio.run(running(manager, scenario))
    assert resyncs >= 4 and busy > 4 * resyncs  # the events flowed faster than the resyncs, and never stopped them
