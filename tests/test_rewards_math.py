"""The math_verify reward (math-verify's extraction and equivalence), and the reward pool that
runs every reward in worker processes with a time limit per call:

- equivalent / different answer pairs as math-verify judges them (fractions vs decimals,
  LaTeX, sqrt, sets, intervals, units in \\text{}, several boxes);
- a reward that hangs (waits on an Event nobody sets) is stopped at its limit: its sample
  scores 0, the others are scored, the step is not held; the pool serves the next batch;
- one that raises, returns nan, or kills its worker scores 0 and is counted; the first failure
  is logged once; a UserError stops the batch; a worker that cannot load its reward stops it;
- a reward's prints do not reach the protocol; meta and ground truth arrive as JSON;
- the config's limit and worker count are validated; the controller's batch scores through the
  pool and reports reward/errors and reward/timeouts.
"""

import time

import pytest

from skyrl_mega.data.math_reward import math_verify_reward, parse_gold
from skyrl_mega.data.reward_pool import RewardCall, RewardPool, RewardWorkerError
from skyrl_mega.data.rewards import get_reward, register_reward, reward_spec
from skyrl_mega.errors import UserError

R = "tests.workers.pool_rewards:"

SAME = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("so the answer is 0.5", "\\frac{1}{2}"),
    ("\\boxed{\\frac{2}{4}}", "1/2"),
    ("\\boxed{\\dfrac{3}{4}}", "$\\frac{3}{4}$"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}"),
    ("\\boxed{(1, 2]}", "(1,2]"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{5\\text{ cm}}", "5"),  # a unit in \text{} is dropped
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{x=2}", "2"),
    ("\\boxed{10}", 10),  # a number as the ground truth
    ("$\\pi$", "\\pi"),
]
DIFFERENT = [
    ("\\boxed{0.6}", "\\frac{1}{2}"),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}"),
    ("\\boxed{[1, 2]}", "(1,2]"),  # closed vs half-open
    ("\\boxed{-3}", "3"),
    ("\\boxed{3.14}", "\\pi"),
    ("\\boxed{50\\%}", "0.5"),  # math-verify keeps a percent sign as text
    ("first \\boxed{3} then \\boxed{4}", "4"),  # several boxes read as the set {3, 4}
    ("no answer here", "4"),
    ("", "4"),
]


@pytest.mark.parametrize("response,truth", SAME)
def test_math_verify_equivalent_answers(response, truth):
    assert math_verify_reward(response, truth, {}) == 1.0


@pytest.mark.parametrize("response,truth", DIFFERENT)
def test_math_verify_different_answers(response, truth):
    assert math_verify_reward(response, truth, {}) == 0.0


def test_math_verify_registered_and_bad_ground_truth():
    assert get_reward("math_verify") is math_verify_reward
    assert reward_spec("math_verify") == "skyrl_mega.data.math_reward:math_verify_reward"
    assert reward_spec("gsm8k") == "skyrl_mega.data.rewards:gsm8k_reward"
    assert len(parse_gold("\\boxed{7}")) > 0
    with pytest.raises(ValueError, match="no ground truth"):
        math_verify_reward("\\boxed{1}", None, {})
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        math_verify_reward("\\boxed{1}", "   ", {})


@pytest.fixture(scope="module")
def pool():
    """Two workers, 0.5 s per call, started (rewards loaded) before the tests time anything."""
    logs = []
    p = RewardPool([R + "exact", R + "hang_on_marker", "math_verify"], workers=2, timeout_s=0.5,
                   log=logs.append)
    p.start()
    p.logs = logs
    yield p
    p.close()


def test_a_hanging_reward_costs_its_sample_not_the_step(pool):
    calls = [RewardCall(R + "hang_on_marker", "hang", "x"), RewardCall(R + "exact", "a", "a"),
             RewardCall("math_verify", "\\boxed{0.5}", "\\frac12"), RewardCall(R + "exact", "a", "b")]
    t0 = time.monotonic()
    res = pool.score(calls)
    took = time.monotonic() - t0
    assert res.rewards == [0.0, 1.0, 1.0, 0.0] and res.timeouts == 1 and res.errors == 0
    assert 0.5 <= took < 5.0, took  # held for the limit, not longer (5 s: a loaded CI box)
    assert len(pool.logs) == 1 and "ran past its 0.5s limit" in pool.logs[0]
    res = pool.score(calls[1:] + calls[:1])  # the stopped worker was replaced: the next batch runs
    assert res.rewards == [1.0, 1.0, 0.0, 0.0] and res.timeouts == 1
    assert len(pool.logs) == 1  # logged once


def test_failing_rewards_score_zero_counted_first_error_logged_once():
    logs = []
    pool = RewardPool([R + "exact"], workers=2, timeout_s=5.0, log=logs.append)
    try:
        calls = [RewardCall("tests.workers.raising_reward:explode", "a", "a"), RewardCall(R + "exact", "a", "a"),
                 RewardCall(R + "nan", "a", "a"), RewardCall(R + "crash", "a", "a"),
                 RewardCall(R + "exact", "b", "b")]
        for _ in range(2):
            res = pool.score(calls)
            assert res.rewards == [0.0, 1.0, 0.0, 0.0, 1.0] and res.errors == 3 and res.timeouts == 0
        assert logs == ["reward 'tests.workers.raising_reward:explode' failed on a sample, which scores 0: "
                        "ValueError: reward exploded on purpose; later failures are only counted (reward/errors)"]
    finally:
        pool.close()


def test_json_inputs_and_a_printing_reward():
    pool = RewardPool(workers=1, timeout_s=5.0, log=lambda m: None)
    try:
        res = pool.score([RewardCall(R + "echo_meta", "r", {"a": None}, {"extra_info": {"k": [1, 2]}, "n": 3}),
                          RewardCall(R + "loud", "r", None), RewardCall(R + "exact", "r", "r")])
        assert res.rewards == [1.0, 1.0, 1.0] and res.errors == 0
    finally:
        pool.close()


def test_what_stops_the_step():
    pool = RewardPool(workers=1, timeout_s=5.0, log=lambda m: None)
    try:
        with pytest.raises(UserError, match="reward misconfigured on purpose: set REWARD_TABLE"):
            pool.score([RewardCall("tests.workers.raising_reward:misconfigured", "a", "a")])
        assert pool.score([RewardCall(R + "exact", "a", "a")]).rewards == [1.0]  # and the pool goes on
    finally:
        pool.close()
    with pytest.raises(RewardWorkerError, match="cannot load the rewards.*no_such_module"):
        RewardPool(["no_such_module:fn"], workers=1).start()

    @register_reward("local_test_reward")
    def local(response, truth, meta):
        return 1.0

    with pytest.raises(UserError, match="a reward worker process cannot import"):
        RewardPool(["local_test_reward"], workers=1)


def test_config_checks_reward_limits():
    from skyrl_mega.config import load_config
    from skyrl_mega.config.field_checks import data_problems

    cfg = load_config(None, ["data.reward_timeout_s=0", "data.reward_workers=0", "data.reward=math_verify"])
    problems = data_problems(cfg, for_training=False)
    assert any("data.reward_timeout_s must be > 0" in p for p in problems), problems
    assert any("data.reward_workers must be >= 1" in p for p in problems), problems
    assert not any("data.reward" in p and "math_verify" in p for p in problems), problems


def test_rollout_batch_scores_through_the_pool(pool):
    """The controller's scoring: per data_source reward names, 0 for the hanging sample, and the
    step's reward/errors and reward/timeouts metrics."""
    from types import SimpleNamespace as NS

    from skyrl_mega.config import load_config
    from skyrl_mega.controller.rollout_batch import build_rl_batch
    from skyrl_mega.data.dataset import PromptItem

    cfg = load_config(None, ["rollout.n_samples_per_prompt=2", f"data.reward={R}hang_on_marker",
                             "+data.reward_by_source.math=math_verify"])
    tokenizer = NS(decode=lambda ids, skip_special_tokens: {1: "a", 2: "hang", 3: "\\boxed{1/2}", 4: "0.4"}[ids[0]])
    items = [PromptItem(0, [9], "a", "default"), PromptItem(1, [9], "0.5", "math")]
    sample = lambda tok: NS(token_ids=[tok], logprobs=[-0.5], routed_experts=None, finish_reason="stop")  # noqa: E731
    rollouts = [NS(prompt_ids=[9], samples=[sample(1), sample(2)]), NS(prompt_ids=[9], samples=[sample(3), sample(4)])]
    _, metrics, texts = build_rl_batch(cfg, tokenizer, items, rollouts, pool)
    assert texts == ["a", "hang", "\\boxed{1/2}", "0.4"]
    assert metrics["reward/default"] == 0.5 and metrics["reward/math"] == 0.5
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/errors"] == 0.0
