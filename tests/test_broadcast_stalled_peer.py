"""The broadcast sender over gloo never waits forever on a peer that stopped receiving.

A vLLM server killed mid-sync can leave its worker process alive in the transfer group, no
longer receiving, while the control call to that server fails. The sender must notice the
failed call, abort the sync with WeightSyncError within seconds (not after the group's
timeout), and drop the transfer group so that the next sync forms a new one.
"""

import os
import subprocess
import sys
import time

import pytest

from skyrl_mega.rollout.errors import WeightSyncError
from skyrl_mega.weight_sync.plan import BucketPlan, BucketSpec, TensorSlot
from skyrl_mega.weight_sync.transports.clients import EngineClient
from skyrl_mega.weight_sync.transports.nccl import NcclBroadcastTransport

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(REPO, "tests", "workers", "stalled_peer.py")
NBYTES = 16 << 20  # large enough that gloo completes a send only once the peer receives it


class StalledServerClient(EngineClient):
    """Control plane of one server whose API process dies during the update: start works,
    update fails after a moment; its worker (stalled_peer.py) stays in the group."""

    def __init__(self):
        self.proc = None

    def num_ranks(self):
        return 1

    def init(self, info, rank_offset):
        self.proc = subprocess.Popen(
            [sys.executable, PEER, info["master_address"], str(info["master_port"]), str(rank_offset),
             str(info["world_size"]), info["group"], str(NBYTES), str(PEER_LINGER_S)], cwd=REPO)

    def start(self):
        return {}

    def update(self, info):
        time.sleep(0.5)
        raise ConnectionError("the server's API process died")

    def finish(self, version):
        raise AssertionError("an aborted sync must not commit")


PEER_LINGER_S = 30


def plan_of(n_buckets):
    buckets = [BucketSpec(index=i, kind="dense", stage=0, nbytes=NBYTES,
                          tensors=[TensorSlot(i, f"w{i}", "uint8", (NBYTES - 64,), 64, NBYTES - 64)])
               for i in range(n_buckets)]
    return BucketPlan(buckets=buckets, bucket_bytes=NBYTES, leaders=[0], ep_members=[(0, 0)], plan_id="0" * 16)


def test_sender_aborts_within_seconds_and_drops_the_group():
    client = StalledServerClient()
    tr = NcclBroadcastTransport(receivers=[client], comm_backend="gloo", num_slots=2, timeout_s=60)
    plan = plan_of(6)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="receiver failed"):
            tr.start(1, plan)
            for b in plan.buckets:
                tr.send_bucket(b, tr.acquire(b, b.nbytes))
            tr.finish()
        tr.abort()
        took = time.monotonic() - t0
        # without the fix the sender blocks until the stalled peer exits (PEER_LINGER_S after it
        # took the first bucket); the margin absorbs a loaded machine's slow peer start-up
        assert took < PEER_LINGER_S - 10, f"the sender noticed the failed receiver only after {took:.1f} s"
        assert tr.comm is None and tr.pool is None  # the next sync forms a new transfer group
    finally:
        tr.close()
        if client.proc is not None:
            client.proc.wait(timeout=PEER_LINGER_S + 30)


class RefusingClient(EngineClient):
    """An engine whose weight-transfer init is refused (vLLM without the backend: HTTP 500)."""

    def num_ranks(self):
        return 1

    def init(self, info, rank_offset):
        raise ConnectionError("Weight transfer not configured")


def test_a_refused_init_fails_the_rendezvous_at_once():
    """The receiver never joins the group: the sender learns it from the failed init call, not
    after the rendezvous' timeout (600 s by default; 60 s here)."""
    tr = NcclBroadcastTransport(receivers=[RefusingClient()], comm_backend="gloo", timeout_s=60)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="init failed.*Weight transfer not configured"):
            tr.init()
        assert time.monotonic() - t0 < 30 and tr.comm is None
    finally:
        tr.close()
