"""Reward functions for tests/test_reward_pool.py, imported by path in reward worker processes
(`tests.workers.pool_rewards:hang`, ...)."""

import os
import threading

NEVER = threading.Event()  # nobody sets it: a call that waits on it hangs until it is stopped


def exact(response, ground_truth, meta):
    return float(response == ground_truth)


def hang(response, ground_truth, meta):
    NEVER.wait()
    return 1.0


def hang_on_marker(response, ground_truth, meta):
    """Hangs on a response of "hang", else scores like `exact`."""
    if response == "hang":
        NEVER.wait()
    return exact(response, ground_truth, meta)


def crash(response, ground_truth, meta):
    os._exit(3)


def nan(response, ground_truth, meta):
    return float("nan")


def loud(response, ground_truth, meta):
    """Prints on stdout (the worker's protocol stream must not see it) and scores 1."""
    print("a reward that prints", flush=True)
    os.write(1, b"and writes to fd 1\n")
    return 1.0


def echo_meta(response, ground_truth, meta):
    """1.0 when meta and ground truth arrived as sent (JSON types)."""
    return float(meta == {"extra_info": {"k": [1, 2]}, "n": 3} and ground_truth == {"a": None})
