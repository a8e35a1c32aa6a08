"""The speculation controllers' decision rules, on synthetic acceptance and costs."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from specd.speculation.acceptance import AcceptanceEstimate, AcceptanceHistory
from specd.speculation.config import PolicySettings
from specd.speculation.controller import GoodputController, Row, StaticController, make_controller, proposes_lookup
from specd.speculation.costs import CostModel
from specd.speculation.exploration import Realised


def costs(fixed: float, per_token: float, draft_fixed: float = 0.0, draft_per_row: float = 0.0) -> CostModel:
    """A cost model that has measured exactly these linear costs."""
    model = CostModel()
    for rows in (1, 2, 4, 8):
        for width in (1, 2, 4, 7):
            model.observe_target(rows, width, fixed + per_token * rows * width)  # per row and per token
        model.observe_draft(rows, 3, 3 * (draft_fixed + draft_per_row * rows))
    return model


def rows(alphas: list[float], budget: int = 8, draft: bool = False) -> list[Row]:
    return [Row(budget, draft, iid(a)) for a in alphas]


def iid(alpha: float) -> AcceptanceEstimate:
    """A request known to accept every proposal position with probability alpha."""
    return AcceptanceEstimate(alpha, 1e9)


def expected_tokens(alpha: float, k: int) -> float:
    return iid(alpha).expected_tokens(k)


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


def test_acceptance_is_estimated_by_position():
    """Bursty acceptance (a round takes all 4 or none, half the time each) yields 1 + 0.5 x 4 = 3
    tokens a round; one rate for every position (4 of 5 positions accepted) would say 3.36."""
    estimate = AcceptanceEstimate(0.5, 1.0)
    for _ in range(200):
        estimate.update(4, 4, 0.05)
        estimate.update(4, 0, 0.05)
    assert estimate.at(0) == pytest.approx(0.5, abs=0.05)
    assert estimate.at(3) == pytest.approx(1.0, abs=0.05)
    assert estimate.expected_tokens(4) == pytest.approx(3.0, abs=0.2)
    assert estimate.at(6) == 0.5  # never reached: the prior


@pytest.mark.parametrize("cost", [costs(0.004, 0.0001), costs(0.001, 0.0005), costs(0.004, 0.0001, 0.0005, 0.0001)])
def test_k_is_monotone_in_acceptance(cost):
    chosen = []
    for alpha in [0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]:
        controller = GoodputController(PolicySettings(), "p", cost)
        ks, _ = controller.choose(rows([alpha] * 4, draft=cost.draft.seen))
        chosen.append(max(ks))
    assert chosen == sorted(chosen), chosen
    assert chosen[0] == 0 and chosen[-1] > 0


def test_no_speculation_when_drafting_cannot_pay():
    # compute-bound target: verifying k+1 tokens costs k+1 steps, so nothing can pay
    controller = GoodputController(PolicySettings(), "p", costs(0.0, 0.001))
    ks, reason = controller.choose(rows([0.6] * 8))
    assert ks == [0] * 8 and reason == "no_gain"
    # dispatch-bound target: extra tokens are nearly free, so speculate
    controller = GoodputController(PolicySettings(), "p", costs(0.010, 0.00001))
    ks, reason = controller.choose(rows([0.6] * 8))
    assert min(ks) > 0 and reason is None


def test_draft_rows_with_low_acceptance_are_left_out():
    controller = GoodputController(PolicySettings(), "p", costs(0.010, 0.00001, 0.0, 0.001))
    plan, _ = controller.choose(rows([0.9, 0.9], draft=True) + rows([0.02, 0.02], draft=True))
    assert plan[0] > 0 and plan[1] > 0 and plan[2:] == [0, 0]


def test_policy_bounds_are_respected():
    cheap = costs(0.010, 0.00001)
    ks, _ = GoodputController(PolicySettings(max_speculative_tokens=2), "p", cheap).choose(rows([0.99] * 3))
    assert max(ks) == 2
    ks, reason = GoodputController(PolicySettings(enabled=False), "p", cheap).plan(rows([0.99] * 3), 3)
    assert ks == [0, 0, 0] and reason == "policy_disabled"
    budgeted = [Row(1, False, iid(0.99)), Row(0, False, iid(0.99))]
    ks, _ = GoodputController(PolicySettings(), "p", cheap).choose(budgeted)
    assert ks == [1, 0]


def test_goodput_probes_one_request_at_a_time_after_turning_off():
    controller = GoodputController(PolicySettings(probe_interval=5), "p", costs(0.0, 0.001))
    plans = [controller.choose(rows([0.05] * 2))[0] for _ in range(10)]
    assert plans == [[0, 0]] * 4 + [[1, 0]] + [[0, 0]] * 4 + [[0, 1]]


def run_steps(controller: GoodputController, batch: int, steps: int, rate_of_k, alpha: float = 0.9) -> list[int]:
    """Plan and "run" steps of rows accepting ``alpha`` of proposals, each step at k taking the
    time that yields the given tokens/s; returns the k of each step."""
    used = []
    for _ in range(steps):
        ks, _ = controller.plan(rows([alpha] * batch), batch)
        k = max(ks)
        used.append(k)
        controller.observe_step(batch, batch * expected_tokens(alpha, k) / rate_of_k(k))
    return used


def achieved(used: list[int], rate: dict[int, float]) -> float:
    """Tokens per second of ``run_steps`` steps run at these k."""
    tokens = [expected_tokens(0.9, k) for k in used]
    return sum(tokens) / sum(t / rate[k] for t, k in zip(tokens, used))


def test_measured_losses_turn_speculation_off_with_ever_rarer_retries():
    """The cost model says speculate (cheap extra tokens), the measurements say it loses:
    after a baseline, only tries of the model's bet remain, as far apart as their cost asks."""
    controller = GoodputController(PolicySettings(), "p", costs(0.010, 0.00001))
    assert controller.plan(rows([0.9] * 4), 4)[1] == "baseline"  # first, measure plain decoding
    controller.observe_step(4, 0.01)
    used = run_steps(controller, 4, 2000, lambda k: 300.0 if k else 400.0)
    assert used[: Realised.TRY - 1] == [0] * (Realised.TRY - 1)
    bet = used[Realised.TRY - 1]
    assert bet >= 4  # cheap extra tokens at high acceptance: a long proposal
    assert set(used) == {0, bet}
    assert achieved(used, {0: 400.0, bet: 300.0}) >= 0.98 * 400  # tries spaced to cost ~1%
    assert controller.plan(rows([0.9] * 4), 4)[1] == "no_gain"
    # another batch-size bucket is measured on its own
    assert controller.plan(rows([0.9] * 16), 16)[1] == "baseline"


def test_rows_whose_estimates_pay_for_nothing_decode_plainly_next_unless_a_probe_is_due():
    """A plan in which no row's estimate pays for a proposal is the next plan too (estimates learn
    only from rounds), so the runner may start the next step ahead, even while the measurements
    still try speculating; never before a step that speculates (a probe, or a measured try)."""
    controller = GoodputController(PolicySettings(probe_interval=4), "p", costs(0.010, 0.00001))
    hopeless = rows([0.0] * 4)
    plans, by_rows = [], 0
    for _ in range(40):
        ks, _ = controller.plan(hopeless, 4)
        plain_next = controller.plain_next(4)
        by_rows += plain_next and not controller.realised[4].plain_next()
        plans.append((any(ks), plain_next))
        controller.observe_step(4, 0.01)
    assert any(speculates for speculates, _ in plans), plans  # probes and tries still run
    assert by_rows >= 3, plans  # steps the rows' estimates alone show to be plain
    assert all(not plans[i + 1][0] for i, (_, plain_next) in enumerate(plans[:-1]) if plain_next), plans
    assert not controller.plain_next(8)  # another batch is not the rows that were planned


def test_a_step_decided_at_k_whose_rows_propose_nothing_is_not_measured_as_ks():
    """The measurements try k, but no row's estimate pays for a proposal, so each such step
    decodes plainly: its seconds are not a step at k, and no try is judged on them."""
    controller = GoodputController(PolicySettings(probe_interval=1000), "p", costs(0.010, 0.00001))
    hopeless = rows([0.0] * 4)
    for _ in range(Realised.TRY + 4 * Realised.TRY):
        assert not any(controller.plan(hopeless, 4)[0])
        controller.observe_step(4, 0.01)
    measured = controller.realised[4]
    assert measured.trying is not None  # a try of k was decided all along ..
    assert set(measured.seconds) == {0} and measured.evidence == {} and measured.pairs == []  # .. and never ran


def test_the_best_k_is_found_by_climbing_from_neighbour_to_neighbour():
    controller = GoodputController(PolicySettings(max_speculative_tokens=6), "p", costs(0.010, 0.01))  # bets k = 1
    rate = {0: 250.0, 1: 300.0, 2: 350.0, 3: 380.0, 4: 340.0, 5: 200.0, 6: 150.0}
    used = run_steps(controller, 1, 600, rate.get)
    assert controller.realised[1].best == 3
    assert achieved(used[-400:], rate) >= 0.97 * rate[3]  # the neighbours' tries cost little
    assert 6 not in used  # never tried: k = 5 already lost to k = 4


def test_plain_decodings_neighbour_is_the_bet_not_k_1():
    """Speculating pays a fixed overhead: k = 1 loses to plain decoding where k = 2 wins."""
    controller = GoodputController(PolicySettings(max_speculative_tokens=4), "p",
                                   costs(0.004, 0.0001, draft_fixed=0.001, draft_per_row=0.0001))
    assert controller.bet(rows([0.8])) >= 2
    rate = {0: 300.0, 1: 250.0, 2: 400.0, 3: 380.0, 4: 350.0}
    used = run_steps(controller, 1, 300, rate.get)
    assert controller.realised[1].best == 2
    assert achieved(used[-200:], rate) >= 0.95 * rate[2]


def test_plain_decoding_is_tried_from_any_k():
    """A workload that stops paying goes straight back to plain decoding, though k = 1 is worse still."""
    controller = GoodputController(PolicySettings(max_speculative_tokens=4), "p", costs(0.010, 0.01))
    run_steps(controller, 1, 300, {0: 300.0, 1: 350.0, 2: 400.0, 3: 380.0, 4: 350.0}.get)
    assert controller.realised[1].best == 2
    run_steps(controller, 1, 2 * Realised.LAST_RETRY, {0: 400.0, 1: 250.0, 2: 300.0, 3: 280.0, 4: 250.0}.get)
    assert controller.realised[1].best == 0


def test_costly_tries_are_spaced_to_the_exploration_budget():
    """A try costing 0.175 s more than plain steps would for its tokens waits 0.175 s / (1% of
    a 10 ms step) = 1750 steps (beyond the usual longest wait), whatever k the model bets on next."""
    measured = Realised()
    measure_plain(measured, 0.01)  # 400 tokens/s
    try_speculating(measured, first_seconds=0.15, then_seconds=0.02)  # 300 tokens/s
    # plain steps would have yielded k = 1's 6 tokens a step in 0.015 s: 0.135 + 8 x 0.005 s extra
    assert measured.next_try[Realised.PLAIN] - measured.steps == pytest.approx(1750, abs=1)
    assert measured.decide(4, lambda: 1, FOUR_ROWS) == (0, "no_gain")
    assert measured.decide(4, lambda: 3, FOUR_ROWS) == (0, "no_gain")


def FOUR_ROWS(k: int) -> float:
    """Expected tokens of four rows accepting half their proposals: 4 at k = 0, 6 at k = 1."""
    return 4 * expected_tokens(0.5, k)


def measure_plain(measured: Realised, seconds: float, ran_ahead: bool | None = None) -> None:
    for _ in range(Realised.TRY):
        assert measured.decide(4, lambda: 1, FOUR_ROWS) == (0, "baseline")
        measured.observe(seconds, ran_ahead=ran_ahead)


def try_speculating(measured: Realised, first_seconds: float, then_seconds: float,
                    plain_seconds: float = 0.01, ran_ahead: bool | None = None) -> None:
    """One try of k = 1: a first step that catches a draft cache up, then steady steps,
    each followed by a plain step (``ran_ahead`` as the runner tells it)."""
    ks = []
    while not ks or measured.trying is not None:
        ks.append(measured.decide(4, lambda: 1, FOUR_ROWS)[0])
        if ks[-1] == 0:
            measured.observe(plain_seconds, ran_ahead=ran_ahead)
        else:
            measured.observe(first_seconds if len(ks) == 1 else then_seconds, caught_up=len(ks) == 1)
    assert ks == [1, 0] * (Realised.TRY + 1)  # the first pair's try step was left out


def test_a_try_is_judged_on_its_steady_steps_not_its_catch_up():
    measured = Realised()
    measure_plain(measured, 0.01)  # 400 tokens/s
    try_speculating(measured, first_seconds=0.10, then_seconds=0.0075)  # 800 tokens/s once caught up
    assert measured.rate(1) == pytest.approx(800)
    assert measured.best == 1
    assert measured.decide(4, lambda: 1, FOUR_ROWS)[0] == 2  # and climbs: k = 2 is tried next


def test_a_try_is_judged_against_the_best_k_at_the_same_speed():
    """The machine doubles its speed as a try starts: k = 1, 10% slower than plain decoding at
    any speed, is compared with the plain steps interleaved with it, not the slower ones before."""
    measured = Realised()
    measure_plain(measured, 0.01)  # 400 tokens/s
    try_speculating(measured, first_seconds=0.02, then_seconds=6 / 720, plain_seconds=0.005)
    assert measured.rate(1) == pytest.approx(720)  # beats the 400 tokens/s measured before the try ..
    assert measured.rate(0) == pytest.approx(800)  # .. not plain decoding at the try's speed
    assert measured.best == 0


def test_plain_steps_a_try_keeps_from_running_ahead_count_as_they_run_once_chosen():
    """Plain steps run ahead of one another at 7 ms; interleaved with a try's they cannot, and
    take 12.5 ms. k = 1 at 11.5 ms yields 1.5 times their tokens: ahead of the slow plain steps
    beside it, behind plain decoding as it runs once chosen, so plain decoding stays best. Where
    the rows could not run ahead (no pace told), the steps beside the try are what plain costs."""
    measured = Realised()
    measure_plain(measured, 0.007, ran_ahead=True)
    try_speculating(measured, first_seconds=0.02, then_seconds=0.0115, plain_seconds=0.0125, ran_ahead=False)
    assert measured.rate(0) == pytest.approx(4 / 0.007)
    assert measured.best == 0
    measured = Realised()
    measure_plain(measured, 0.007)
    try_speculating(measured, first_seconds=0.02, then_seconds=0.0115, plain_seconds=0.0125)
    assert measured.best == 1


def test_a_try_wins_only_by_a_margin_its_pairs_agree_on():
    """Step times swing by 10% either way from pair to pair: k = 1 measured 2% ahead of plain
    decoding is not adopted on that evidence, 15% ahead is."""
    def best_after_a_try(ahead: float) -> int:
        measured = Realised()
        measure_plain(measured, 0.01)
        swings = itertools.cycle((1.1, 0.9))
        while True:
            k = measured.decide(4, lambda: 1, FOUR_ROWS)[0]  # k = 1 yields 1.5x plain's tokens
            measured.observe(0.015 / ahead * next(swings) if k else 0.01)
            if measured.trying is None:
                return measured.best

    assert best_after_a_try(1.02) == 0
    assert best_after_a_try(1.15) == 1


def after_a_losing_try(seconds_at_1: float, catch_up_seconds: float = 0.15) -> Realised:
    """Plain steps of 10 ms, then a try of k = 1 whose steps take ``seconds_at_1`` after a
    first one that catches the draft up (by default costly, as at a large batch)."""
    measured = Realised()
    measure_plain(measured, 0.01)
    try_speculating(measured, first_seconds=catch_up_seconds, then_seconds=seconds_at_1)
    assert measured.best == 0
    return measured


def steps_to_a_try(measured: Realised, tokens, steps: int) -> int | None:
    """Plain steps decided before the next try starts (None: no try within ``steps``)."""
    for done in range(steps):
        if measured.decide(4, lambda: 1, tokens)[0]:
            return done
        measured.observe(0.01)
    return None


def test_hopeless_tries_from_plain_decoding_wait_while_their_measurement_is_fresh():
    """k = 1 measured at 1.8x a plain step's seconds for 1.5x its tokens (17% short of paying):
    its due tries are skipped at no cost until the measurement is STALE steps old, but a try
    runs when due once its rows accept enough that k = 1 could pay (1.95x the tokens)."""
    measured = after_a_losing_try(0.018)
    assert measured.versus_plain[1][0] == pytest.approx(1.8)
    due = measured.next_try[Realised.PLAIN] - measured.steps - 1
    stale = measured.versus_plain[1][1] + Realised.STALE - measured.steps - 1
    assert 0 < due < stale
    waited = steps_to_a_try(measured, FOUR_ROWS, 2 * Realised.STALE)
    assert stale <= waited <= stale + measured.retry[Realised.PLAIN]  # found at the first due time after going stale

    measured = after_a_losing_try(0.018)
    assert steps_to_a_try(measured, lambda k: 4 * expected_tokens(0.95, k), 2 * Realised.STALE) == due
    # a step at k = 2 costs at least k = 1's 1.8x: its 1.75x tokens cannot pay either
    measured = after_a_losing_try(0.018)
    assert steps_to_a_try(measured, FOUR_ROWS, due + 200) is None
    assert measured.decide(4, lambda: 2, FOUR_ROWS)[0] == 0
    # a try that fell short by less than HOPELESS keeps its usual schedule
    measured = after_a_losing_try(0.016)  # 1.5x the tokens for 1.6x the seconds: 6% short
    due = measured.next_try[Realised.PLAIN] - measured.steps - 1
    assert steps_to_a_try(measured, FOUR_ROWS, 2 * Realised.STALE) == due


def test_cheap_tries_are_never_skipped():
    """A try that costs a few plain steps (a small batch's catch-up) keeps its backoff schedule
    however badly it measured: one try's verdict can be far off, and a skip would trust it."""
    measured = after_a_losing_try(0.018, catch_up_seconds=0.03)
    assert measured.versus_plain == {}
    due = measured.next_try[Realised.PLAIN] - measured.steps - 1
    assert due < Realised.LAST_RETRY
    assert steps_to_a_try(measured, FOUR_ROWS, 2 * Realised.STALE) == due


def test_a_new_bucket_starts_from_the_nearest_smaller_ones_measurements():
    """Speculating lost by half at 4 rows: at 8 rows (where it can only cost more) plain decoding
    is measured and no try follows; at 2 rows, with nothing smaller measured, k = 1 is tried."""
    def losing(k: int) -> float:
        return 200.0 if k else 400.0

    controller = GoodputController(PolicySettings(max_speculative_tokens=1), "p", costs(0.010, 0.00001))
    assert 1 in run_steps(controller, 4, 300, losing)
    assert 1 in controller.realised[4].versus_plain
    assert set(run_steps(controller, 8, 300, losing)) == {0}
    assert 1 in run_steps(controller, 2, 300, losing)
    fresh = GoodputController(PolicySettings(max_speculative_tokens=1), "p", costs(0.010, 0.00001))
    assert 1 in run_steps(fresh, 8, 300, losing)  # what the 8-row bucket would have tried on its own
    # what went stale in the nearest smaller bucket (8 rows, where it was inherited) is not passed on
    controller.realised[8].steps += Realised.STALE
    assert 1 in run_steps(controller, 16, 300, losing)


def steps_to_adopt(ahead: float, seed: int, steps: int = 2000) -> int | None:
    """Steps until a Realised adopts k = 1 when it yields ``ahead`` times plain decoding's tokens
    per second and every step's time swings by a lognormal 15% (as pairs of steps do here)."""
    rng = random.Random(seed)
    measured = Realised()
    for step in range(steps):
        k = measured.decide(4, lambda: 1, FOUR_ROWS)[0]
        seconds = 0.01 if k == 0 else 0.01 * FOUR_ROWS(1) / FOUR_ROWS(0) / ahead
        measured.observe(seconds * math.exp(rng.gauss(0.0, 0.15)))
        if measured.best == 1:
            return step
    return None


def test_undecided_tries_pool_their_pairs_until_they_decide():
    """k = 1 is 8% ahead of plain decoding, within what one try's 8 noisy pairs can tell apart:
    its tries come back soon and pool their pairs, so it is adopted within a few hundred steps
    (each try judged alone, some of these seeds took over 1,000 steps, one over 4,000: a try
    that fell short backed off)."""
    adopted = [steps_to_adopt(1.08, seed) for seed in range(12)]
    assert None not in adopted and max(adopted) < 400, adopted


def test_tries_without_sign_of_a_gain_back_off():
    """k = 1 is 8% behind: it is never adopted, and its tries spread out so that their steps cost
    less than the exploration budget (1% of the decode time)."""
    for seed in range(8):
        measured = Realised()
        rng = random.Random(seed)
        tried = 0
        for _ in range(3000):
            k = measured.decide(4, lambda: 1, FOUR_ROWS)[0]
            tried += k == 1
            measured.observe((0.01 if k == 0 else 0.01 * 1.5 / 0.92) * math.exp(rng.gauss(0.0, 0.15)))
            assert measured.best == 0
        assert tried * 0.08 < Realised.EXPLORE_BUDGET * 3000, tried


def backed_off_after_losing_tries(seconds_at_1: float, tokens_at_1: float) -> Realised:
    """Plain steps of 10 ms and tries of k = 1 that lose (a step at k = 1 takes ``seconds_at_1``
    for ``tokens_at_1`` times the tokens), until a verdict leaves the next try 512 steps away."""
    measured = Realised()
    rng = random.Random(0)
    was_trying = False
    while not (was_trying and measured.trying is None and measured.retry.get(Realised.PLAIN, 0) >= 512):
        was_trying = measured.trying is not None
        k = measured.decide(4, lambda: 1, lambda k: 4 * (tokens_at_1 if k else 1.0))[0]
        measured.observe((seconds_at_1 if k else 0.01) * math.exp(rng.gauss(0.0, 0.05)))
    assert measured.best == 0
    return measured


def test_a_backed_off_try_comes_early_once_its_rows_would_pay():
    """k = 1 measured at 1.35x a plain step's seconds for 1.2x its tokens: its tries back off to
    hundreds of steps apart.  Once its rows' expected tokens beat those seconds by more than
    PROMISING (2x the tokens), the next try comes as soon as losing tries can afford (their cost
    within the exploration budget), not at the backed-off spacing; a smaller rise waits for it."""
    measured = backed_off_after_losing_tries(0.0135, 1.2)
    due = measured.next_try[Realised.PLAIN] - measured.steps - 1
    early = measured.earliest[Realised.PLAIN] - measured.steps - 1
    assert Realised.FIRST_RETRY <= early < due // 2
    assert steps_to_a_try(measured, lambda k: 4 * (2.0 if k else 1.0), due) == early

    measured = backed_off_after_losing_tries(0.0135, 1.2)
    due = measured.next_try[Realised.PLAIN] - measured.steps - 1
    assert steps_to_a_try(measured, lambda k: 4 * (1.4 if k else 1.0), 2 * due) == due


def test_a_switch_keeps_the_evidence_against_the_old_best():
    """Once k = 1 is adopted (500 tokens/s to plain decoding's 400), plain decoding's first try
    back pools with that evidence reversed, so one lucky try (533 tokens/s, which alone would
    win) does not flip the best back."""
    measured = Realised()
    measure_plain(measured, 0.01)

    def step(plain_seconds: float) -> None:
        k = measured.decide(1, lambda: 1, FOUR_ROWS)[0]
        measured.observe(0.012 if k else plain_seconds)

    while measured.best == 0:
        step(0.01)
    assert all(a < 0 for a in measured.evidence[0])
    while measured.trying != 0:
        step(0.01)
    while measured.trying is not None:
        step(0.0075)
    assert measured.best == 1


def test_new_requests_start_from_recent_requests_by_position():
    """Requests that accepted bursts (all 4 proposals or none, half the time each) seed a new
    request's estimate position by position: 3 tokens expected at k = 4 before it has run a
    round, where one rate for every position (4 of 5 reached positions accepted) would say 3.36."""
    history = AcceptanceHistory()
    for _ in range(30):
        request = history.seed(StaticController.PRIOR_WEIGHT)
        for _ in range(100):
            request.update(4, 4, 0.05)
            request.update(4, 0, 0.05)
        history.absorb(request)
    fresh = history.seed(StaticController.PRIOR_WEIGHT)
    assert fresh.at(0) == pytest.approx(0.5, abs=0.05) and fresh.at(3) == pytest.approx(1.0, abs=0.05)
    assert fresh.expected_tokens(4) == pytest.approx(3.0, abs=0.2)
    history.absorb(history.seed(StaticController.PRIOR_WEIGHT))  # a request that never speculated
    assert history.seed(StaticController.PRIOR_WEIGHT) == fresh


def test_the_history_pools_requests_not_rounds():
    """Ten requests that accepted a fifth of their proposals, then one whose output fell into a
    loop and had 300 rounds accepted: the next request starts near the requests' average
    (about 0.3), not the rounds' (0.75)."""
    history = AcceptanceHistory()
    for _ in range(10):
        request = history.seed(StaticController.PRIOR_WEIGHT)
        for round in range(100):
            request.update(1, int(round % 5 == 0), 0.1)
        history.absorb(request)
    looping = history.seed(StaticController.PRIOR_WEIGHT)
    for _ in range(300):
        looping.update(1, 1, 0.1)
    history.absorb(looping)
    assert history.seed(StaticController.PRIOR_WEIGHT).at(0) < 0.35


def test_each_pair_is_judged_on_its_own_steps_expected_tokens():
    """k = 1 yields 500 tokens/s to plain decoding's 400 for seven pairs; in the last pair every
    row has reached its max_tokens, so no proposal fits and both steps are plain ones. Judged
    by that last step's rows alone, k = 1 would seem to add nothing for its dearer steps."""
    measured = Realised()
    measure_plain(measured, 0.01)
    ending = lambda k: 4.0  # noqa: E731 (rows with no room left: one token whatever k)
    for step in range(2 * Realised.TRY):
        last_pair = step >= 2 * Realised.TRY - 2
        k = measured.decide(4, lambda: 1, ending if last_pair else FOUR_ROWS)[0]
        assert k == (1 if step % 2 == 0 else 0)
        measured.observe(0.01 if last_pair or not k else 0.012)
    assert measured.trying is None and measured.best == 1


def test_tries_are_judged_on_expected_not_counted_tokens():
    """A try's steps yield what chance gives; the requests' acceptance estimates decide."""
    measured = Realised()
    measure_plain(measured, 0.01)
    try_speculating(measured, first_seconds=0.01, then_seconds=0.012)  # 6 tokens in 0.012 s: 500/s
    assert measured.best == 1  # whatever these steps happened to accept


def test_measured_gains_keep_speculation_on():
    controller = GoodputController(PolicySettings(max_speculative_tokens=1), "p", costs(0.010, 0.00001))
    used = run_steps(controller, 2, 1280, lambda k: 450.0 if k else 300.0)
    assert used.count(1) >= 1280 * 0.95  # tries of plain decoding, ever rarer, keep the comparison honest


def test_a_workload_that_starts_paying_is_picked_up_by_a_retry():
    """Text that turns repetitive: acceptance rises from 10% to 95%, and with it what a
    speculative step yields for its (unchanged) seconds."""
    controller = GoodputController(PolicySettings(max_speculative_tokens=2), "p", costs(0.010, 0.00001))
    step = {0: 0.01, 1: 0.016, 2: 0.02}
    run_steps(controller, 4, 300, lambda k: 4 * expected_tokens(0.1, k) / step[k], alpha=0.1)
    measured = controller.realised[4]
    assert measured.best == 0
    wait = max(measured.next_try.values()) - measured.steps
    assert wait < Realised.STALE  # the retry comes on its schedule, before anything measured could go stale
    later = run_steps(controller, 4, wait + 1000, lambda k: 4 * expected_tokens(0.95, k) / step[k], alpha=0.95)
    found = next(i for i, k in enumerate(later) if k)
    assert found <= wait  # found at the next retry ..
    judged = later[found + 2 * Realised.TRY:]  # (its steps interleaved with plain ones)
    assert sum(1 for k in judged if k) > 0.95 * len(judged)  # .. then kept


def test_measurements_and_acceptance_outlive_a_policy_swap():
    measured: dict[int, Realised] = {}
    history = AcceptanceHistory()
    first = make_controller(PolicySettings(), "p", costs(0.010, 0.00001), measured, history)
    run_steps(first, 1, 100, lambda k: 450.0 if k else 300.0)
    estimate = first.new_estimate()
    first.observe([estimate], [2], [2], [2])
    history.absorb(estimate)
    second = make_controller(PolicySettings(max_speculative_tokens=2), "p", first.costs, measured, history)
    assert second.plan(rows([0.9]), 1)[0] != [0]
    assert second.ema == first.ema and second.new_estimate() == first.new_estimate()
    assert make_controller(PolicySettings(mode="static"), "p", first.costs, measured, history).measured_steps() == {}


def test_static_mode_follows_the_seed_rules():
    controller = StaticController(PolicySettings(mode="static", max_speculative_tokens=3, disable_by_batch_size=4,
                                                 acceptance_rate_threshold=0.3, probe_interval=4), "p")
    assert controller.plan(rows([0.5] * 2, budget=5), 2) == ([3, 3], None)
    assert controller.plan(rows([0.5] * 4, budget=5), 4) == ([0] * 4, "batch_size")
    controller.observe([iid(0.5)], [4], [0], [4])  # EMA 0: below the threshold
    offs = [controller.plan(rows([0.5], budget=5), 1)[1] for _ in range(4)]
    assert offs == ["low_acceptance"] * 3 + [None]  # the 4th step probes



@pytest.mark.parametrize("policy", [None, PolicySettings(mode="static", max_speculative_tokens=6)])
def test_the_k_asked_is_shortened_when_its_last_proposals_do_not_pay(policy):
    """As requests ask (no policy) or under a static one, k is a ceiling: a draft model at 40%
    acceptance on a machine where every verified token costs as much as a plain step yields
    most at k = 1, never at 0 (a request that asked to speculate does); a cheap verify keeps k."""
    steep = StaticController(policy, "p", costs(0.0, 0.001, 0.0005, 0.0001))
    assert steep.plan(rows([0.4] * 4, budget=5, draft=True), 4) == ([1] * 4, None)
    # budgets below the chosen k stay theirs; a seeded sampling row keeps its k (its RNG stream follows it)
    assert steep.plan([Row(0, True, iid(0.4)), Row(3, True, iid(0.4))], 2) == ([0, 1], None)
    assert steep.plan([Row(3, True, iid(0.4)), Row(3, True, iid(0.4), seeded=True)], 2) == ([1, 3], None)
    flat = StaticController(policy, "p", costs(0.010, 0.00001))
    assert flat.plan(rows([0.4] * 4, budget=5, draft=True), 4) == ([5] * 4, None)
    # nothing measured beside a plain step: every width is modelled alike, k stays as asked
    unmeasured = CostModel()
    unmeasured.observe_target(4, 6, 0.05)
    unmeasured.observe_draft(4, 5, 0.05)
    assert StaticController(policy, "p", unmeasured).plan(rows([0.4] * 4, budget=5, draft=True), 4) == ([5] * 4, None)

def test_estimates_move_towards_what_is_observed():
    controller = GoodputController(PolicySettings(ema_alpha=0.5), "p", costs(0.01, 0.0))
    estimate = controller.new_estimate()
    assert estimate.at(0) == pytest.approx(0.5)
    for _ in range(10):
        controller.observe([estimate], [4], [4], [4])
    assert estimate.at(0) > 0.9 and estimate.at(3) > 0.9
    assert controller.new_estimate().at(0) > 0.9  # new requests start from the model's history


def test_a_lookup_that_finds_nothing_counts_against_the_k_chosen():
    """n-gram rows planned k = 3 that found no match half the time (and were always right
    otherwise) yield 1 + 0.5 x 3 tokens per step at k = 3, and the estimate says so;
    the model's acceptance rate counts only tokens proposed."""
    controller = GoodputController(PolicySettings(ema_alpha=0.05), "p", costs(0.01, 0.0))
    estimate = controller.new_estimate()
    for _ in range(200):
        controller.observe([estimate], [3], [3], [3])
        controller.observe([estimate], [0], [0], [3])
    assert estimate.expected_tokens(3) == pytest.approx(2.5, abs=0.15)
    assert controller.ema == pytest.approx(1.0)


def test_where_the_draft_model_runs_it_drafts_for_the_rows_whose_lookups_cover_k_too():
    """Lookups covering six of eight rows: the goodput controller still plans k for the two
    others (a lookup's acceptance is not what a row's estimate measured of the draft model's
    proposals, so leaving those rows out to spare the draft step's fixed part misjudged it), and
    the draft model then drafts for all eight; lookups covering every row stand in for it. A row
    whose estimate does not pay for its drafting is still left out."""
    cost = costs(0.004, 0.0001, draft_fixed=0.002, draft_per_row=0.00005)
    controller = GoodputController(PolicySettings(max_speculative_tokens=3), "p", cost)

    def row(lookup: int, alpha: float = 0.8) -> Row:
        return Row(3, True, iid(alpha), lookup)
    planned = [row(3)] * 6 + [row(1), row(0)]
    ks, _ = controller.choose(planned)
    assert all(ks) and len(set(ks)) == 1, ks  # at the k whose draft steps they pay for
    assert proposes_lookup(planned, ks) == [False] * 8
    covered = [row(3)] * 8
    ks, _ = controller.choose(covered)
    assert ks == [3] * 8 and proposes_lookup(covered, ks) == [True] * 8
    cheaper = GoodputController(PolicySettings(max_speculative_tokens=3), "p",
                                costs(0.004, 0.0001, draft_fixed=0.0005, draft_per_row=0.0002))
    ks, _ = cheaper.choose([row(0)] * 7 + [row(0, alpha=0.01)])
    assert all(ks[:7]) and ks[7] == 0, ks
