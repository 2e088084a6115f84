"""A reward module that imports in the trainer but not in a reward worker process (where
SKYRL_MEGA_REWARD_WORKER is set): the controller cannot start its reward workers, a failure on
rank 0 alone (tests/test_rank0_failure.py)."""

import os

if os.environ.get("SKYRL_MEGA_REWARD_WORKER"):
    raise ValueError("reward module broken on purpose in the reward worker")


def score(response, ground_truth, meta):
    return 0.0
