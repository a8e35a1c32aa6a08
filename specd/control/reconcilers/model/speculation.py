"""A Model's DraftPairing and SpecPolicy applied to its running engine, between steps.
The DraftPairing and SpecPolicy reconcilers report on them."""

from __future__ import annotations

import asyncio

from ....core.request import NO_SPECULATION, Method
from ...state import ModelState, Pairing, Policy
from .context import ModelContext


class SpeculationSettings:
    def __init__(self, ctx: ModelContext):
        self.ctx = ctx

    def pairing(self, state: ModelState, pairing: Pairing | None) -> None:
        """Attach, change or detach the Model's drafter as its DraftPairing says."""
        engine, running = state.serving.engine, state.running
        if running.pairing == pairing or running.task is not None and not running.task.done():
            return
        if pairing is None:
            engine.configure_speculation(NO_SPECULATION, None)
            running.pairing, running.pairing_error = None, ""
            return
        current = running.pairing
        same_drafter = (current is not None and current.method == pairing.method
                        and current.spec.source == pairing.spec.source and not running.pairing_error)
        if pairing.method == Method.NGRAM or same_drafter:
            engine.configure_speculation(pairing.speculation(), engine.drafter_module if same_drafter else None)
            running.pairing, running.pairing_error = pairing, ""
            self.ctx.enqueue("DraftPairing", pairing.name)
            return
        running.task = self.ctx.spawn(self._attach(state, pairing), state.name)

    async def _attach(self, state: ModelState, pairing: Pairing) -> None:
        """Load a pairing's drafter off the loop and attach it; a failure is this generation's
        outcome (``pairing_error`` goes with ``pairing``), reported by its reconciler."""
        ctx, engine, running = self.ctx, state.serving.engine, state.running
        try:
            draft = await asyncio.to_thread(engine.load_drafter, pairing.method, pairing.spec.source, pairing.name)
        except Exception as exc:
            running.pairing, running.pairing_error = pairing, f"{type(exc).__name__}: {exc}"
            ctx.store.record_event("DraftPairing", pairing.name, "Warning", "DraftLoadFailed", running.pairing_error)
            engine.configure_speculation(NO_SPECULATION, None)
        else:
            engine.configure_speculation(pairing.speculation(), draft)
            running.pairing, running.pairing_error = pairing, ""
            ctx.store.record_event("DraftPairing", pairing.name, "Normal", "Attached", f"drafting for {state.name}")
        ctx.enqueue("DraftPairing", pairing.name)

    def policy(self, state: ModelState, policy: Policy | None) -> None:
        """The first policy (by name) whose selector matches the Model's labels, applied to its engine."""
        running, m = state.running, self.ctx.metrics
        if running.policy == policy:
            return
        if running.policy is not None:
            for gauge in (m.spec_policy_enabled, m.spec_policy_max_tokens, m.spec_policy_generation):
                gauge.remove(state.name, running.policy.name)
        state.serving.engine.set_policy(policy.settings() if policy else None, policy.name if policy else None)
        running.policy = policy
        if policy is not None:
            m.spec_policy_enabled.labels(state.name, policy.name).set(1 if policy.spec.enabled else 0)
            m.spec_policy_max_tokens.labels(state.name, policy.name).set(policy.spec.max_speculative_tokens)
            m.spec_policy_generation.labels(state.name, policy.name).set(policy.generation)
            self.ctx.event(state.name, "Normal", "PolicyApplied",
                           f"SpecPolicy {policy.name} generation {policy.generation}")
