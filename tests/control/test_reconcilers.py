"""The reconcilers on their own: a real store, the real manager, real tiny engines, no HTTP.
What the routes see is the serving registry's entry, which the Model reconciler writes."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path

import mlx.core as mx

from specd.control.plane import ControlPlane
from specd.core import attention
from specd.metrics import Metrics
from specd.serving.registry import ModelRegistry, Phase
from specd.store import Store


def model(name: str, source: Path, **spec) -> dict:
    return {"kind": "Model", "name": name, "labels": {}, "annotations": {}, "spec": {"source": str(source), **spec}}


def pairing(name: str, target: str, **spec) -> dict:
    return {"kind": "DraftPairing", "name": name, "labels": {}, "annotations": {},
            "spec": {"targetRef": target, **spec}}


async def until(predicate, timeout: float = 120.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        assert loop.time() < deadline, "the control plane never got there"
        await asyncio.sleep(0.02)
    return value


def run(tmp_path: Path, scenario) -> None:
    async def main():
        store = Store(tmp_path / "specd.db")
        control = ControlPlane(store, ModelRegistry(Metrics()), drain_grace=1)
        task = asyncio.create_task(control.run())
        try:
            await scenario(store, control)
        finally:
            task.cancel()
            await control.shutdown(1)
    asyncio.run(main())


def condition(store: Store, kind: str, name: str) -> dict:
    return next((c for c in store.get(kind, name).status.get("conditions", []) if c["type"] == "Ready"), {})


def test_the_model_reconciler_loads_scales_and_removes_a_model(forged, tmp_path):
    """A Model loads into the registry's entry; a change of replicas alone keeps its engine; a
    deleted Model leaves the registry and its engine drains."""
    async def scenario(store: Store, control: ControlPlane):
        registry = control.registry
        store.apply([model("m", forged / "target")])
        served = await until(lambda: (m := registry.models.get("m")) is not None and m.engine is not None and m)
        engine = served.engine
        assert served.phase is Phase.READY and served.task == "generate"
        await until(lambda: condition(store, "Model", "m").get("reason") == "Loaded")
        store.apply([model("m", forged / "target", replicas=2)])  # a standalone daemon: one runs
        status = await until(lambda: (s := store.get("Model", "m").status)["observedGeneration"] == 2 and s)
        assert served.engine is engine and status["servedGeneration"] == 2 and status["readyReplicas"] == 1
        assert any(c["reason"] == "Unschedulable" for c in status["conditions"] if c["type"] == "Scheduled")
        store.delete("Model", "m")
        await until(lambda: "m" not in registry.models and "m" not in control.models.states)
    run(tmp_path, scenario)


def masks_remembered() -> int:
    """Attention masks and the other arrays steps share that the process-wide memos hold (which
    layout a step takes, and so which of them it fills, depends on the device)."""
    return sum(len(memo) for memo in attention._STEP_ARRAYS)


def test_a_model_removed_hands_its_memory_back_once_drained(forged, tmp_path):
    """Once a Model's engine has drained, the arrays it held (weights, KV, caches, the attention
    masks its steps remembered) are freed and none stays in MLX's cache: an unloaded Model gives
    its memory back at once, not at the next collection or load."""
    async def scenario(store: Store, control: ControlPlane):
        store.apply([model("m", forged / "target")])
        served = await until(lambda: (m := control.registry.models.get("m")) is not None and m.engine is not None
                             and m)
        engine = weakref.ref(served.engine)
        del served
        assert masks_remembered()  # its load's probes and warm-up asked for some
        store.delete("Model", "m")
        await until(lambda: "m" not in control.registry.models)
        await until(lambda: engine() is None and not mx.get_cache_memory(), 30)
        await until(lambda: not masks_remembered(), 30)  # up to 64 MiB of them stayed, for no engine
    run(tmp_path, scenario)


def test_a_pairing_s_condition_describes_its_own_generation_only(forged, tmp_path):
    """A DraftPairing re-applied with another drafter that fails reports the new generation's
    failure, never the older one's message under the newer generation."""
    async def scenario(store: Store, control: ControlPlane):
        store.apply([model("t", forged / "target")])
        await until(lambda: (m := control.registry.models.get("t")) is not None and m.engine is not None)
        store.apply([pairing("p", "t", method="draft", source="/nowhere/one")])
        first = await until(lambda: (c := condition(store, "DraftPairing", "p")).get("reason") == "DraftLoadFailed"
                            and c)
        assert "one" in first["message"] and first["observedGeneration"] == 1
        seen = []  # every condition the pairing's status is written with from here on
        store.watch_status(lambda kind, name: kind == "DraftPairing" and seen.append(condition(store, kind, name)))
        store.apply([pairing("p", "t", method="draft", source="/nowhere/two")])
        second = await until(lambda: (c := condition(store, "DraftPairing", "p")).get("reason") == "DraftLoadFailed"
                             and c["observedGeneration"] == 2 and c)
        assert "two" in second["message"]
        assert [c for c in seen if c["observedGeneration"] == 2 and "one" in c.get("message", "")] == []
        store.apply([pairing("p", "t", method="draft", source=str(forged / "draft"))])
        await until(lambda: condition(store, "DraftPairing", "p").get("reason") == "Attached")
    run(tmp_path, scenario)
