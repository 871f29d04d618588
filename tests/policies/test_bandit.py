"""UCB index, the sliding-window learner, and BanditPolicy driven through telemetry by a seeded
synthetic environment: concentration and sublinear regret when stationary, tracking after a shift,
per-context learning."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.bandit import BanditPolicy, SlidingWindowUCB, ucb_index
from policies.telemetry import Telemetry
from tests.policies.builders import make_slo, make_telemetry, make_tier_window

# --- the index, pure -----------------------------------------------------------------------------


def test_ucb_index_formula() -> None:
    assert ucb_index(0.5, 4, 100, 1.0) == pytest.approx(0.5 + math.sqrt(math.log(100) / 4))
    assert ucb_index(0.5, 4, 100, 0.0) == 0.5
    assert ucb_index(0.5, 2.5, 10.0, 0.3) == pytest.approx(0.5 + 0.3 * math.sqrt(math.log(10.0) / 2.5))


def test_ucb_index_unplayed_arm_is_infinite_and_bonus_shrinks_with_count() -> None:
    assert ucb_index(0.0, 0, 10, 1.0) == math.inf
    bonuses = [ucb_index(0.0, n, 1000, 1.0) for n in (1, 2, 4, 8, 16)]
    assert all(b1 > b2 for b1, b2 in zip(bonuses, bonuses[1:], strict=False))
    assert ucb_index(0.3, 1, 1, 1.0) == 0.3  # ln 1 = 0
    assert ucb_index(0.3, 0.5, 0.5, 1.0) == 0.3  # total < 1 gives no bonus (no negative log)


# --- the learner ---------------------------------------------------------------------------------


def test_learner_plays_every_arm_once_first_then_exploits() -> None:
    learner = SlidingWindowUCB(3, c=0.1, rng=np.random.default_rng(0), window=50)
    first = []
    for _ in range(3):
        arm = learner.select()
        first.append(arm)
        learner.update(1.0 if arm == 1 else 0.0)
    assert sorted(first) == [0, 1, 2]
    for i in range(20):
        arm = learner.select()
        learner.update(1.0 if arm == 1 else 0.0)
        assert arm == 1, f"pull {i}"


def test_sliding_window_forgets_old_pulls_and_discount_decays_them() -> None:
    learner = SlidingWindowUCB(2, c=0.0, rng=np.random.default_rng(0), window=3)
    for reward in (1.0, 1.0, 1.0, 0.0, 0.0):
        learner.last_arm = 0
        learner.update(reward)
    counts, sums = learner.stats()
    assert counts.tolist() == [3.0, 0.0] and sums.tolist() == [1.0, 0.0]
    discounted = SlidingWindowUCB(2, c=0.0, rng=np.random.default_rng(0), window=None, discount=0.5)
    for _ in range(3):
        discounted.last_arm = 1
        discounted.update(1.0)
    counts, _ = discounted.stats()
    assert counts.tolist() == [0.0, 1.75]


def test_learner_validates_parameters() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="exactly one of window"):
        SlidingWindowUCB(2, 0.1, rng, window=10, discount=0.9)
    with pytest.raises(ValueError, match="discount"):
        SlidingWindowUCB(2, 0.1, rng, window=None, discount=1.5)
    with pytest.raises(ValueError, match="update"):
        SlidingWindowUCB(2, 0.1, rng).update(1.0)


# --- the policy in a synthetic environment -------------------------------------------------------

ARMS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
#: share of requests meeting the SLO per arm. High load: more T, more met; low load: all but T=0 meet.
HIGH_LOAD = [0.3, 0.5, 0.7, 0.9, 0.95, 0.97]
LOW_LOAD = [0.6, 0.97, 0.97, 0.97, 0.97, 0.97]
COMPLETIONS = 40


def distortion_of(t: float) -> float:
    return 0.2 * t  # crosses the standard tier's 0.15 budget at T = 0.75


def expected_reward(policy: BanditPolicy, attainment: float, t: float) -> float:
    d, budget = distortion_of(t), 0.15
    return (
        attainment
        - policy.distortion_weight * d / budget
        - policy.distortion_penalty * max(0.0, d - budget) / budget
    )


class Environment:
    """One 1 s telemetry window per tick: binomial SLO attainment, noisy distortion. The requests that
    finish in a window arrived ``lag`` windows earlier (their E2E), so the window's outcome is that of
    the arm in play back then — the reward is lagged, as in a serving system."""

    def __init__(self, seed: int, lag: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.lag = lag
        self.played: list[float | None] = []  # threshold pushed at each tick
        self.source_arm: dict[float, float] = {}  # window time → threshold whose requests finished in it

    def window(
        self, tick: int, threshold: float | None, attainment_by_arm: list[float], arrivals: int = 20
    ) -> Telemetry:
        self.played.append(threshold)
        # Requests finishing in (tick, tick + 1] arrived in the window `lag` ticks earlier, under the
        # threshold in force then (pushed at the end of the tick before it).
        source_tick = tick - self.lag
        source = self.played[source_tick] if source_tick >= 0 else None
        time_s = float(tick + 1)
        if source is None:  # nothing finishes yet
            return make_telemetry(time_s=time_s, arrivals=arrivals, completions=0)
        self.source_arm[time_s] = source
        p = attainment_by_arm[ARMS.index(source)]
        met = int(self.rng.binomial(COMPLETIONS, p))
        distortion = distortion_of(source) * math.exp(0.1 * self.rng.standard_normal())
        e2e_ms = 1000.0 * self.lag + 500.0
        window = make_tier_window(
            threshold=source, completions=COMPLETIONS, slo_met=met, mean_distortion=distortion, e2e_ms=e2e_ms
        )
        return make_telemetry(time_s=time_s, arrivals=arrivals, tiers={"standard": window})


def run(
    policy: BanditPolicy, seed: int, schedule: list[list[float]], env: Environment | None = None
) -> list[int]:
    """Play one tick per entry of ``schedule`` (the attainment table in force); return arm indices."""
    env = env or Environment(seed)
    threshold: float | None = None
    pulls = []
    for tick, table in enumerate(schedule):
        decision = policy.decide(env.window(tick, threshold, table))
        threshold = decision.thresholds["standard"]
        pulls.append(ARMS.index(threshold))
    return pulls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stationary_concentrates_on_best_arm_with_sublinear_regret(seed: int) -> None:
    # window ≥ horizon: nothing is forgotten, so this is UCB1's stationary guarantee.
    policy = BanditPolicy(make_slo(), arms=ARMS, window=1000, c=0.2, seed=seed)
    means = [expected_reward(policy, p, t) for p, t in zip(HIGH_LOAD, ARMS, strict=True)]
    best = int(np.argmax(means))
    assert ARMS[best] == 0.6  # 0.8 meets more requests but its distortion breaks the budget
    pulls = run(policy, seed, [HIGH_LOAD] * 1000)
    regret = np.cumsum([means[best] - means[a] for a in pulls])
    first_half, second_half = regret[499], regret[-1] - regret[499]
    assert np.mean(np.array(pulls[500:]) == best) >= 0.95
    assert second_half < 0.5 * first_half, f"regret {first_half:.1f} then {second_half:.1f}: not sublinear"


def test_stationary_with_default_window_still_prefers_the_best_arm() -> None:
    policy = BanditPolicy(make_slo(), arms=ARMS, seed=3)  # window 100: keeps re-checking other arms
    pulls = run(policy, 3, [HIGH_LOAD] * 600)
    # Each re-check costs a whole episode (one uncredited window + min_credited credited ones).
    assert np.mean(np.array(pulls[300:]) == ARMS.index(0.6)) >= 0.65


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_after_a_load_shift_moves_to_the_new_best_arm_within_60_windows(seed: int) -> None:
    policy = BanditPolicy(make_slo(), arms=ARMS, seed=seed)  # default sliding window of 100
    shift = 300
    pulls = np.array(run(policy, seed, [LOW_LOAD] * shift + [HIGH_LOAD] * 300))
    # Settled before the shift: T = 0.2 is the modal arm (T = 0.4 is only 0.027 behind, so it gets pulls too).
    assert np.bincount(pulls[200:shift], minlength=len(ARMS)).argmax() == ARMS.index(0.2)
    new_best = pulls == ARMS.index(0.6)
    moved = next((i for i in range(shift, len(pulls) - 20) if new_best[i : i + 20].mean() >= 0.7), None)
    assert moved is not None and moved - shift <= 60, (
        f"moved after {None if moved is None else moved - shift}"
    )
    assert new_best[shift + 100 :].mean() >= 0.65


def alternate_loads(policy: BanditPolicy, seed: int) -> dict[str, np.ndarray]:
    """Load alternates every 25 windows: 10 req/s (low) or 40 req/s (high). Returns the T picked per
    load over the second half."""
    env = Environment(seed)
    threshold: float | None = None
    picks: dict[str, list[float]] = {"low": [], "high": []}
    previous_load = "low"
    for tick in range(1200):
        load = "low" if (tick // 25) % 2 == 0 else "high"
        # The window just closed ran under the previous tick's load; the next arm is picked for this one.
        table = LOW_LOAD if previous_load == "low" else HIGH_LOAD
        telemetry = env.window(tick, threshold, table, arrivals=10 if load == "low" else 40)
        threshold = policy.decide(telemetry).thresholds["standard"]
        if tick >= 600:
            picks[load].append(threshold)
        previous_load = load
    return {load: np.array(ts) for load, ts in picks.items()}


def test_contextual_variant_learns_the_best_arm_per_load_bin() -> None:
    contextual = alternate_loads(
        BanditPolicy(make_slo(), arms=ARMS, context_bins=[25.0], window=400, min_credited=1, seed=5), 5
    )
    # Low load: T = 0.2 is best (0.4 trails by only 0.027); what matters is not running T ≥ 0.6 there.
    assert np.mean(contextual["low"] == 0.2) >= 0.5
    assert np.mean(contextual["low"] >= 0.6) <= 0.2
    assert np.mean(contextual["high"] == 0.6) >= 0.8
    # Without the context the same learner settles on the high-load arm for both loads.
    blind = alternate_loads(BanditPolicy(make_slo(), arms=ARMS, window=400, min_credited=1, seed=5), 5)
    assert np.mean(blind["low"] >= 0.6) >= 0.5


# --- policy details ------------------------------------------------------------------------------


def test_window_without_completions_keeps_the_arm_and_credits_nothing() -> None:
    policy = BanditPolicy(make_slo(), arms=ARMS, seed=0)
    first = policy.decide(make_telemetry(time_s=1.0)).thresholds["standard"]
    for i in range(5):
        decision = policy.decide(make_telemetry(time_s=float(i + 2), completions=0))
        assert decision.thresholds["standard"] == first, f"tick {i}"
        assert "no evidence" in decision.reason
    assert sum(int(learner.pulls.sum()) for learner in policy.learners) == 0


def test_reward_counts_rejections_as_misses_and_penalises_distortion_over_budget() -> None:
    policy = BanditPolicy(make_slo(), arms=ARMS, distortion_weight=0.1, distortion_penalty=2.0)
    window = make_tier_window(completions=20, slo_met=18, mean_distortion=0.0)
    assert policy.reward(make_telemetry(tiers={"standard": window})) == pytest.approx(0.9)
    # 20 completions, 5 rejections overall: the tier takes all 5 (it has all the completions).
    assert policy.reward(make_telemetry(rejections=5, tiers={"standard": window})) == pytest.approx(18 / 25)
    within = make_tier_window(completions=20, slo_met=20, mean_distortion=0.15)
    over = make_tier_window(completions=20, slo_met=20, mean_distortion=0.30)
    assert policy.reward(make_telemetry(tiers={"standard": within})) == pytest.approx(1 - 0.1)
    assert policy.reward(make_telemetry(tiers={"standard": over})) == pytest.approx(1 - 0.2 - 2.0)


def test_reward_without_tier_windows_uses_aggregate_percentiles() -> None:
    policy = BanditPolicy(make_slo(), arms=ARMS)
    assert policy.reward(make_telemetry(tpot_ms=50.0)) == pytest.approx(1.0)  # under 60 ms
    assert policy.reward(make_telemetry(tpot_ms=70.0)) == 0.0


def test_arms_with_draft_length_set_the_decision_and_other_tiers_follow_the_fraction() -> None:
    policy = BanditPolicy(make_slo(), arms=[(0.5, 3)], seed=0)
    decision = policy.decide(make_telemetry())
    assert decision.draft_lengths == {"standard": 3, "economy": 3}  # the pinned lossless tier keeps its k
    assert decision.thresholds == {"lossless": 0.0, "standard": 0.5, "economy": 2.0}


def test_bad_arms_raise_naming_the_arm() -> None:
    with pytest.raises(ValueError, match=r"arms\[1\]: T=1.5 outside tier 'standard'"):
        BanditPolicy(make_slo(), arms=[0.0, 1.5])
    with pytest.raises(ValueError, match=r"arms\[0\]: draft length"):
        BanditPolicy(make_slo(), arms=[(0.5, -1)])
    with pytest.raises(ValueError, match="context_bins"):
        BanditPolicy(make_slo(), context_bins=[5.0, 1.0])


def test_same_seed_same_choices_and_reset_replays() -> None:
    a = BanditPolicy(make_slo(), arms=ARMS, seed=7)
    b = BanditPolicy(make_slo(), arms=ARMS, seed=7)
    schedule = [HIGH_LOAD] * 50
    first = run(a, 1, schedule)
    assert run(b, 1, schedule) == first
    a.reset()
    assert run(a, 1, schedule) == first


def test_regression_infinite_distortion_is_not_credited_and_does_not_crash() -> None:
    policy = BanditPolicy(make_slo(), arms=ARMS, seed=0)
    first = policy.decide(make_telemetry(time_s=1.0)).thresholds["standard"]
    broken = make_tier_window(completions=20, slo_met=20, mean_distortion=math.inf)
    decision = policy.decide(make_telemetry(time_s=2.0, tiers={"standard": broken}))
    assert decision.thresholds["standard"] == first
    assert sum(int(learner.pulls.sum()) for learner in policy.learners) == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_lagged_reward_is_credited_to_the_arm_whose_requests_produced_it(seed: int) -> None:
    # Requests take 12 windows from arrival to completion: a window's outcome belongs to the arm in
    # play 12 ticks earlier. Every credited reward must come from the arm it is credited to.
    env = Environment(seed, lag=12)
    policy = BanditPolicy(make_slo(), arms=ARMS, window=1000, c=0.2, seed=seed)
    pulls = run(policy, seed, [HIGH_LOAD] * 1500, env=env)
    assert len(policy.credit_log) >= 100
    wrong = [(t, arm) for t, arm, _ in policy.credit_log if env.source_arm[t] != ARMS[arm]]
    assert not wrong, f"rewards credited to the wrong arm at {wrong[:5]}"
    assert np.mean(np.array(pulls[-300:]) == ARMS.index(0.6)) >= 0.6


def test_crediting_the_current_arm_under_lag_would_mislabel_rewards() -> None:
    # The check the gate replaces: with a 12-window lag, the arm in play when a window closes is often
    # not the one whose requests finished in it (what the old policy credited).
    env = Environment(0, lag=12)
    policy = BanditPolicy(make_slo(), arms=ARMS, window=1000, c=0.2, seed=0)
    pulls = run(policy, 0, [HIGH_LOAD] * 400, env=env)
    in_play = {float(tick + 1): ARMS[pulls[tick - 1]] for tick in range(1, len(pulls))}
    mismatched = sum(1 for t, source in env.source_arm.items() if t in in_play and in_play[t] != source)
    assert mismatched >= 20
