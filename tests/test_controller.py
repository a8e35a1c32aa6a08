"""The speculation controllers' decision rules, on synthetic acceptance and costs."""

from __future__ import annotations

import pytest

from specd.api.manifest import SpecPolicySpec
from specd.spec.controller import (AcceptanceEstimate, GoodputController, Realised, Row, StaticController,
                                   expected_tokens)
from specd.spec.costs import CostModel


def costs(fixed: float, per_token: float, draft_fixed: float = 0.0, draft_per_row: float = 0.0) -> CostModel:
    """A cost model that has measured exactly these linear costs."""
    model = CostModel()
    for rows in (1, 2, 4, 8):
        for width in (1, 2, 4, 7):
            model.observe_target(rows, width, fixed + per_token * rows * width)  # per row and per token
        model.observe_draft(rows, 3, 3 * (draft_fixed + draft_per_row * rows))
    return model


def rows(alphas: list[float], budget: int = 8, draft: bool = False) -> list[Row]:
    return [Row(budget, draft, AcceptanceEstimate(a * 1000, (1 - a) * 1000)) for a in alphas]


def policy(**kw) -> SpecPolicySpec:
    return SpecPolicySpec(match_labels={}, **kw)


def test_cost_table_predicts_unmeasured_shapes_from_measured_ones():
    model = CostModel()
    model.observe_target(1, 1, 0.004)
    model.observe_target(1, 4, 0.005)  # dispatch-bound: 4 tokens cost 1.25 steps
    model.observe_target(16, 1, 0.012)
    model.observe_target(16, 4, 0.024)  # compute-bound: 2 steps
    assert model.target_seconds(16, 4) == pytest.approx(0.024)
    assert model.target_seconds(8, 1) == pytest.approx(0.004 + 0.008 * 7 / 15)  # interpolated
    assert model.target_seconds(12, 4) == pytest.approx(model.target_seconds(12, 1) * 2.0)  # nearest: B=16
    assert model.target_seconds(2, 4) == pytest.approx(model.target_seconds(2, 1) * 1.25)  # nearest: B=1
    # width 3 was never measured: extrapolated from width 4 at the nearest batch size (B=1, 1.25x)
    assert model.target_seconds(4, 3) == pytest.approx(model.target_seconds(4, 1) * (1 + 0.25 * 2 / 3))
    assert model.target_seconds(32, 1) == pytest.approx(0.024)  # beyond the largest batch: scaled up
    fresh = CostModel()
    fresh.observe_target(4, 1, 0.01)
    assert fresh.target_seconds(4, 5) == pytest.approx(0.01)  # no speculative step measured yet: explore


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("cost", [costs(0.004, 0.0001), costs(0.001, 0.0005), costs(0.004, 0.0001, 0.0005, 0.0001)])
def test_k_is_monotone_in_acceptance(cost):
    chosen = []
    for alpha in [0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]:
        controller = GoodputController(policy(), "p", cost)
        ks, _ = controller.choose(rows([alpha] * 4, draft=cost.draft.seen))
        chosen.append(max(ks))
    assert chosen == sorted(chosen), chosen
    assert chosen[0] == 0 and chosen[-1] > 0


def test_no_speculation_when_drafting_cannot_pay():
    # compute-bound target: verifying k+1 tokens costs k+1 steps, so nothing can pay
    controller = GoodputController(policy(), "p", costs(0.0, 0.001))
    ks, reason = controller.choose(rows([0.6] * 8))
    assert ks == [0] * 8 and reason == "no_gain"
    # dispatch-bound target: extra tokens are nearly free, so speculate
    controller = GoodputController(policy(), "p", costs(0.010, 0.00001))
    ks, reason = controller.choose(rows([0.6] * 8))
    assert min(ks) > 0 and reason is None


def test_draft_rows_with_low_acceptance_are_left_out():
    controller = GoodputController(policy(), "p", costs(0.010, 0.00001, 0.0, 0.001))
    plan, _ = controller.choose(rows([0.9, 0.9], draft=True) + rows([0.02, 0.02], draft=True))
    assert plan[0] > 0 and plan[1] > 0 and plan[2:] == [0, 0]


def test_policy_bounds_are_respected():
    cheap = costs(0.010, 0.00001)
    ks, _ = GoodputController(policy(max_speculative_tokens=2), "p", cheap).choose(rows([0.99] * 3))
    assert max(ks) == 2
    ks, reason = GoodputController(policy(enabled=False), "p", cheap).plan(rows([0.99] * 3), 3)
    assert ks == [0, 0, 0] and reason == "policy_disabled"
    budgeted = [Row(1, False, AcceptanceEstimate(99, 1)), Row(0, False, AcceptanceEstimate(99, 1))]
    ks, _ = GoodputController(policy(), "p", cheap).choose(budgeted)
    assert ks == [1, 0]


def test_goodput_probes_one_request_at_a_time_after_turning_off():
    controller = GoodputController(policy(probe_interval=5), "p", costs(0.0, 0.001))
    plans = [controller.choose(rows([0.05] * 2))[0] for _ in range(10)]
    assert plans == [[0, 0]] * 4 + [[1, 0]] + [[0, 0]] * 4 + [[0, 1]]


def run_steps(controller: GoodputController, batch: int, steps: int, plain_rate: float, spec_rate: float) -> int:
    """Plan and "run" steps whose measured tokens/s are given; returns how many speculated."""
    speculated = 0
    for _ in range(steps):
        ks, _ = controller.plan(rows([0.9] * batch), batch)
        on = max(ks) > 0
        speculated += on
        controller.observe_step(batch, max(ks), batch, batch / (spec_rate if on else plain_rate))
    return speculated


def test_measured_losses_turn_speculation_off_with_ever_rarer_retries():
    """The cost model says speculate (cheap extra tokens), the measurements say it loses:
    after a baseline and a first try, only retries at 16, 32, .. 256 steps remain."""
    controller = GoodputController(policy(), "p", costs(0.010, 0.00001))
    assert controller.plan(rows([0.9] * 4), 4)[1] == "baseline"  # first, measure plain decoding
    controller.observe_step(4, 0, 4, 0.01)
    speculated = run_steps(controller, 4, 1000, plain_rate=400.0, spec_rate=300.0)
    assert speculated <= 100  # tries of k = 8, 4, 2, 1 (4 steps each), then again after 32, 64, .. steps
    assert controller.realised[4].retry_every >= 256
    assert controller.plan(rows([0.9] * 4), 4)[1] == "no_gain"
    # another batch-size bucket is measured on its own
    assert controller.plan(rows([0.9] * 16), 16)[1] == "baseline"


def try_speculating(measured: Realised, first_seconds: float, then_seconds: float, tokens: int = 4,
                    k: int = 1) -> None:
    """One try: a first step that catches a draft cache up, then steady steps."""
    assert measured.decide() is None
    measured.observe(k, tokens, first_seconds)
    for _ in range(Realised.TRIAL - 1):
        assert measured.decide() is None
        measured.observe(k, tokens, then_seconds)


def test_costly_tries_are_spaced_to_the_exploration_budget():
    """A try costing 0.055 s more than plain steps waits 0.055 s / (1% of a 10 ms step) = 550 steps."""
    measured = Realised()
    measured.observe(0, 4, 0.01)
    try_speculating(measured, first_seconds=0.05, then_seconds=0.015)  # 0.04 + 3 x 0.005 s extra
    assert measured.retry_every == pytest.approx(550, abs=1)
    assert measured.decide() == "no_gain"


def test_a_losing_try_with_a_long_k_is_followed_by_a_shorter_one():
    controller = GoodputController(policy(), "p", costs(0.010, 0.00001))  # the model bets on long k
    controller.observe_step(1, 0, 1, 0.004)
    measured = controller.realised[1]
    ks, _ = controller.plan(rows([0.9]), 1)
    assert ks[0] >= 4
    try_speculating(measured, first_seconds=0.006, then_seconds=0.010, tokens=2, k=ks[0])  # 200 < 250 tokens/s
    assert measured.k_cap == ks[0] // 2
    assert measured.wait == pytest.approx(500, abs=1)  # 0.02 s extra within 1% of 4 ms steps
    assert controller.plan(rows([0.9]), 1) == ([0], "no_gain")
    for _ in range(measured.wait):
        controller.observe_step(1, 0, 1, 0.004)
    assert controller.plan(rows([0.9]), 1)[0] == [ks[0] // 2]


def test_a_try_is_judged_on_its_steady_steps_not_its_catch_up():
    measured = Realised()
    measured.observe(0, 4, 0.01)  # 400 tokens/s plain
    try_speculating(measured, first_seconds=0.10, then_seconds=0.0075, tokens=6)  # 800 tokens/s once caught up
    assert measured.speculative == pytest.approx(800)
    assert measured.decide() is None and measured.retry_every == Realised.FIRST_RETRY


def test_measured_gains_keep_speculation_on_and_refresh_the_baseline():
    controller = GoodputController(policy(), "p", costs(0.010, 0.00001))
    speculated = run_steps(controller, 2, 640, plain_rate=300.0, spec_rate=450.0)
    assert speculated >= 640 - 640 // Realised.REFRESH - 2  # a plain step now and then keeps the baseline honest


def test_a_workload_that_starts_paying_is_picked_up_by_a_retry():
    controller = GoodputController(policy(), "p", costs(0.010, 0.00001))
    run_steps(controller, 4, 300, plain_rate=400.0, spec_rate=200.0)
    assert controller.realised[4].speculative < controller.realised[4].plain
    later = run_steps(controller, 4, 800, plain_rate=400.0, spec_rate=800.0)
    assert later > 800 - Realised.LAST_RETRY - 16  # found at the next retry, then kept


def test_static_mode_follows_the_seed_rules():
    controller = StaticController(policy(mode="static", max_speculative_tokens=3, disable_by_batch_size=4,
                                         acceptance_rate_threshold=0.3, probe_interval=4), "p")
    assert controller.plan(rows([0.5] * 2, budget=5), 2) == ([3, 3], None)
    assert controller.plan(rows([0.5] * 4, budget=5), 4) == ([0] * 4, "batch_size")
    controller.observe([AcceptanceEstimate(1, 1)], [4], [0])  # EMA 0: below the threshold
    offs = [controller.plan(rows([0.5], budget=5), 1)[1] for _ in range(4)]
    assert offs == ["low_acceptance"] * 3 + [None]  # the 4th step probes


def test_estimates_move_towards_what_is_observed():
    controller = GoodputController(policy(ema_alpha=0.5), "p", costs(0.01, 0.0))
    estimate = controller.new_estimate()
    assert estimate.alpha == pytest.approx(0.5)
    for _ in range(10):
        controller.observe([estimate], [4], [4])
    assert estimate.alpha > 0.9
    assert controller.new_estimate().alpha > 0.9  # new requests start from the model's history
