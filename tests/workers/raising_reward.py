"""A reward function that raises: how a user's buggy reward reaches the RL loop (import path
`tests.workers.raising_reward:explode`)."""


def explode(response, ground_truth, meta):
    raise ValueError("reward exploded on purpose")


def misconfigured(response, ground_truth, meta):
    from skyrl_mega.errors import UserError

    raise UserError("reward misconfigured on purpose: set REWARD_TABLE (tests.workers.raising_reward)")
