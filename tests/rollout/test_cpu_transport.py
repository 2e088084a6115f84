"""SharedMemoryTransport with a fake control plane (fast, no vLLM): call order, files,
version checks, cleanup."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega.rollout.errors import WeightSyncError
from skyrl_mega.weight_sync.transports.shm import SharedMemoryTransport


class FakeControl:
    urls = ["http://a", "http://b"]

    def __init__(self, report=None):
        self.calls = []
        self.report = report  # None: echo the manifest's version
        self.seen_files = {}

    def pause(self, mode, timeout_s=None):
        self.calls.append(("pause", mode))

    def resume(self):
        self.calls.append(("resume",))

    def collective_rpc(self, method, kwargs, timeout_s=None):
        m = json.loads(kwargs["manifest"])
        self.calls.append((method, m["version"]))
        n = 0
        for f in m["files"]:
            self.seen_files[f] = load_file(f)
            n += len(self.seen_files[f])
        rep = self.report or {"version": m["version"], "num_tensors": n}
        return {u: [dict(rep)] for u in self.urls}

    def set_weight_version(self, v):
        self.calls.append(("set_weight_version", v))

    def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return {u: True for u in self.urls}


def tensors(prefix, k=3):
    return [(f"{prefix}.{i}.weight", torch.full((2, 3), float(i))) for i in range(k)]


def test_update_call_order_files_and_cleanup(tmp_path):
    ctl = FakeControl()
    t = SharedMemoryTransport(ctl, shm_root=str(tmp_path), pause_mode="wait")
    with t.update(7) as send:
        send(tensors("experts"))
        send(tensors("attn", 2))
    assert [c[0] for c in ctl.calls] == ["pause", "skyrl_load_weights", "set_weight_version", "reset_prefix_cache", "resume"]
    assert ctl.calls[0] == ("pause", "wait") and ctl.calls[1] == ("skyrl_load_weights", 7)
    assert ctl.calls[3] == ("reset_prefix_cache", True)  # recompute: frozen requests redo their KV
    assert t.last_report == {u: [{"version": 7, "num_tensors": 5}] for u in ctl.urls}
    assert len(ctl.seen_files) == 2  # one safetensors file per bucket
    got = {k: v for f in ctl.seen_files.values() for k, v in f.items()}
    assert torch.equal(got["experts.2.weight"], torch.full((2, 3), 2.0))
    assert os.listdir(tmp_path) == []  # files removed
    assert t.bytes_sent == 5 * 6 * 4


def test_version_mismatch_leaves_engines_paused(tmp_path):
    ctl = FakeControl(report={"version": 6, "num_tensors": 3})
    t = SharedMemoryTransport(ctl, shm_root=str(tmp_path))
    t.start(7)
    t.send(tensors("x"))
    with pytest.raises(WeightSyncError, match="expected version 7"):
        t.finish()
    assert ("resume",) not in ctl.calls
    assert os.listdir(tmp_path) == [] and not t.active


def test_errors_in_send_abort_and_resume(tmp_path):
    ctl = FakeControl()
    t = SharedMemoryTransport(ctl, shm_root=str(tmp_path))
    with pytest.raises(WeightSyncError, match="sent twice"):
        with t.update(1) as send:
            send(tensors("x"))
            send(tensors("x"))
    assert ctl.calls[-1] == ("resume",) and os.listdir(tmp_path) == []
    with pytest.raises(WeightSyncError, match="before start"):
        t.send(tensors("x"))
    t.start(2)
    with pytest.raises(WeightSyncError, match="in progress"):
        t.start(3)
    with pytest.raises(WeightSyncError, match="nothing was sent"):
        t.finish()
    with pytest.raises(ValueError):
        SharedMemoryTransport(ctl, pause_mode="freeze")
