"""Placement -> weight transport and engine flags (skyrl_mega/controller/placement.py)."""

import json
from types import SimpleNamespace

import pytest

from skyrl_mega.controller.placement import plan_placement


def _rollout(transport="auto", sleep_level=1, urls=()):
    return SimpleNamespace(weight_transport=transport, sleep_level=sleep_level, external_urls=list(urls))


OTHER_HOST = "http://192.0.2.7:8000"  # TEST-NET-1: never an address of this machine


def _own_address():
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    pytest.skip("this machine has no non-loopback IPv4 address")


@pytest.mark.parametrize("cuda", [False, True])
def test_engines_on_another_host_get_the_transport_that_crosses_hosts(cuda):
    """auto picks nccl (gloo on CPU) when an external engine is on another machine; shm and
    cuda_ipc, which hand weights over on this host only, are refused with the reason. Engines on
    this machine, by loopback or by one of its own addresses, keep the table's transport."""
    assert plan_placement("disaggregated", _rollout(urls=["http://127.0.0.1:8000", OTHER_HOST]), cuda=cuda).transport \
        == "nccl"
    for want in ("shm", "cuda_ipc"):
        if cuda and want == "shm":
            continue
        with pytest.raises(ValueError, match=f"weight_transport={want} hands weights over on this host only.*"
                                             "192.0.2.7.*use rollout.weight_transport=nccl"):
            plan_placement("disaggregated", _rollout(want, urls=[OTHER_HOST]), cuda=cuda)
    own = f"http://{_own_address()}:8000"
    assert plan_placement("colocated", _rollout(urls=[own, "http://localhost:9"]), cuda=cuda).transport == \
        ("cuda_ipc" if cuda else "shm")


def test_validate_names_a_transport_that_cannot_reach_other_hosts():
    from skyrl_mega.config import load_config
    from skyrl_mega.config.field_checks import rollout_problems

    cfg = load_config(None, ["model.path=/nonexistent", f"rollout.external_urls=[{OTHER_HOST}]",
                             "rollout.weight_transport=shm", "placement=disaggregated"])
    problems = rollout_problems(cfg, probe=False)
    assert any("weight_transport=shm hands weights over on this host only" in p for p in problems), problems


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
