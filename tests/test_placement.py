"""Placement -> weight transport and engine flags (skyrl_mega/controller/placement.py)."""

import json
from types import SimpleNamespace

import pytest

from skyrl_mega.controller.placement import plan_placement


def _rollout(transport="auto", sleep_level=1):
    return SimpleNamespace(weight_transport=transport, sleep_level=sleep_level)


@pytest.mark.parametrize("placement, cuda, want, transport, sleep", [
    ("colocated", True, "auto", "cuda_ipc", 1),
    ("disaggregated", True, "auto", "nccl", None),
    ("colocated", False, "auto", "shm", None),
    ("disaggregated", False, "auto", "shm", None),
    ("disaggregated", False, "nccl", "nccl", None),  # the protocol over gloo on a CPU box
    ("colocated", False, "cuda_ipc", "cuda_ipc", None),  # over /dev/shm files on CPU
    ("colocated", True, "nccl", "nccl", 1),
])
def test_transport_per_placement(placement, cuda, want, transport, sleep):
    plan = plan_placement(placement, _rollout(want), cuda=cuda)
    assert (plan.transport, plan.sleep_level) == (transport, sleep)
    args = plan.server_args()
    if transport == "shm":
        assert args == []
    else:  # the engines must run the skyrl_bucket weight-transfer backend
        assert args[0] == "--weight-transfer-config" and json.loads(args[1]) == {"backend": "skyrl_bucket"}


def test_bad_transport_choices():
    with pytest.raises(ValueError, match="weight_transport must be auto or one of"):
        plan_placement("colocated", _rollout("rdma"), cuda=False)
    with pytest.raises(ValueError, match="shm is the CPU transport"):
        plan_placement("colocated", _rollout("shm"), cuda=True)
    with pytest.raises(ValueError, match="placement must be"):
        plan_placement("both", _rollout(), cuda=False)


def test_colocated_engines_sleep_for_training_and_wake_weights_then_kv_cache():
    """The loop's order on a colocated GPU: sleep after rollout, wake the weights before the sync
    (the KV cache is not allocated while the trainer holds its memory), the KV cache after it."""
    from skyrl_mega.controller.engines import RolloutEngines
    from skyrl_mega.controller.placement import PlacementPlan

    calls = []

    class Control:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags=None):
            calls.append(("wake_up", tuple(tags or ())))

    engines = RolloutEngines.__new__(RolloutEngines)
    engines.control = Control()
    engines.plan = PlacementPlan("colocated", "gpu", "cuda_ipc", 2)
    m = {**engines.before_training(), **engines.before_sync(), **engines.before_rollout()}
    assert calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    assert {"time/engine/sleep_s", "time/engine/wake_weights_s", "time/engine/wake_kv_s"} <= set(m)
    engines.plan = PlacementPlan("colocated", "cpu", "shm", None)  # CPU: engines never sleep
    assert engines.before_training() == {} and len(calls) == 3
