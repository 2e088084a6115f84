"""rollout.verify_sync=first_last verifies the first sync of every run (a resumed one too) and the last."""

from skyrl_mega.controller.steps import verify_due


def test_first_last_covers_a_resumed_runs_first_sync_and_the_last_step():
    assert verify_due("first_last", 0, 10, first=True)
    assert verify_due("first_last", 4, 10, first=True)  # resumed from step 4: its first sync is version 4
    assert not verify_due("first_last", 5, 10, first=False)
    assert verify_due("first_last", 10, 10, first=False)
    assert verify_due("always", 5, 10, first=False)
    assert not verify_due("never", 0, 10, first=True)
