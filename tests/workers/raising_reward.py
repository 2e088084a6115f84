"""A reward function that raises: how a user's buggy reward reaches the RL loop (import path
`tests.workers.raising_reward:explode`)."""


def explode(response, ground_truth, meta):
    raise ValueError("reward exploded on purpose")
