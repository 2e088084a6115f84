"""IPC handles travel as typed JSON, are rebuilt without unpickling, and anything else is refused.

- CPU: a /dev/shm buffer's handle is plain JSON; another process opens it from that JSON,
  reads what the producer wrote and writes back (the producer sees it).
- A handle in the old pickled form (or any unknown form) is refused by ipc_handles and by the
  vLLM engine backend before anything in it runs; a typed handle loads through the engine's
  own receive path.
- CUDA (skipped without it): a CUDA buffer round-trips between two processes the same way.
"""

import base64
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from skyrl_mega.weight_sync import ipc_handles

from .conftest import REPO

_RAN: list = []


def _mark(*args):
    """Called only if a handle's payload gets unpickled (it must not be)."""
    _RAN.append(args)


class _Payload:
    def __reduce__(self):
        return (_mark, ("unpickled",))


def _pickled_handle() -> dict:
    """The old wire form: base64 of a pickle, here one that runs _mark when loaded."""
    blob = pickle.dumps((_Payload(), (None,) * 7 + (b"h", 1, 0) + (None,) * 5))
    return {"kind": "cuda", "device": 0, "pickle": base64.b64encode(blob).decode()}


def _plain_json(h) -> bool:
    if isinstance(h, dict):
        return all(isinstance(k, str) and _plain_json(v) for k, v in h.items())
    if isinstance(h, list):
        return all(_plain_json(v) for v in h)
    return h is None or isinstance(h, (str, int, float, bool))


def _child(code: str, stdin: str, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_READ_AND_WRITE_BACK = """
import json, sys, torch
from skyrl_mega.weight_sync import ipc_handles
h = json.loads(sys.stdin.read())
dev = torch.device("cuda", 0) if h["kind"] == "cuda" else None
buf = ipc_handles.decode(h, dev)
n = buf.numel()
seen = buf[: n // 2].to(torch.int64).sum().item()
buf[n // 2:] = 7
if buf.is_cuda:
    torch.cuda.synchronize(dev)
print(json.dumps({"n": n, "sum": seen, "key": list(ipc_handles.handle_key(h))}))
"""


def test_cpu_handle_is_plain_json_and_opens_in_another_process():
    buf, path = ipc_handles.shm_buffer(4096)
    try:
        buf.copy_(torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8))
        h = ipc_handles.encode(buf, path)
        assert _plain_json(h) and "pickle" not in h and h["kind"] == "shm"
        wire = json.dumps(h)
        got = _child(_READ_AND_WRITE_BACK, wire)
        assert got["n"] == 4096 and got["sum"] == buf[:2048].to(torch.int64).sum().item()
        assert got["key"] == list(ipc_handles.handle_key(json.loads(wire)))
        assert torch.equal(buf[2048:], torch.full((2048,), 7, dtype=torch.uint8))  # the consumer's writes
    finally:
        os.unlink(path)


def test_pickled_and_unknown_handles_are_refused_without_running_anything(tmp_path):
    _RAN.clear()
    for fn in (ipc_handles.decode, ipc_handles.handle_key):
        with pytest.raises(ValueError, match="typed IPC handle"):
            fn(_pickled_handle())
    assert _RAN == []
    buf, path = ipc_handles.shm_buffer(64)
    try:
        good = ipc_handles.encode(buf, path)
        for bad in ({**good, "extra": 1}, {**good, "nbytes": True}, {**good, "nbytes": 1 << 20},
                    {**good, "kind": "pickle"}, [good], "shm"):
            with pytest.raises(ValueError):
                ipc_handles.decode(bad)
        other = tmp_path / (ipc_handles.SHM_PREFIX + "x")  # a file outside /dev/shm
        other.write_bytes(b"\0" * 64)
        with pytest.raises(ValueError, match="not a buffer file"):
            ipc_handles.decode({**good, "path": str(other)})
        assert torch.equal(ipc_handles.decode(json.loads(json.dumps(good))), buf)
    finally:
        os.unlink(path)


class _FakeModel:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded += [(n, t.clone()) for n, t in weights]


def _engine():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from skyrl_mega.weight_sync.vllm_engine import SkyrlBucketWeightTransferEngine

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(rank=0, world_size=1), model_config=None)
    return SkyrlBucketWeightTransferEngine(None, cfg, torch.device("cpu"), _FakeModel())


def test_vllm_engine_refuses_a_pickled_handle_and_loads_from_a_typed_one():
    eng = _engine()
    eng.init_transfer_engine(eng.parse_init_info({"mode": "ipc"}))
    buf, path = ipc_handles.shm_buffer(1024)
    try:
        w = torch.randn(4, 8)
        buf[512: 512 + w.numel() * 4].copy_(w.view(-1).view(torch.uint8))
        entries = [["model.w", "float32", [4, 8], 0, 512, w.numel() * 4, 0]]
        info = {"mode": "ipc", "version": 3, "round": 0, "last": True, "layout_id": "L0", "tensors": entries}
        _RAN.clear()
        with pytest.raises(ValueError, match="typed IPC handle"):
            eng.update_weights({**info, "handles": [_pickled_handle()]})
        assert _RAN == [] and eng.model.loaded == []
        eng.update_weights(json.loads(json.dumps({**info, "handles": [ipc_handles.encode(buf, path)]})))
        assert [n for n, _ in eng.model.loaded] == ["model.w"]
        assert torch.equal(eng.model.loaded[0][1], w)
    finally:
        os.unlink(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_handle_round_trips_between_processes():
    dev = torch.device("cuda", 0)
    t = torch.arange(1 << 20, dtype=torch.int64, device=dev).remainder(251).to(torch.uint8)
    whole, off = ipc_handles.storage_bytes(t)
    assert off == 0
    torch.cuda.synchronize(dev)
    h = ipc_handles.encode(whole)
    assert _plain_json(h) and "pickle" not in h and h["kind"] == "cuda"
    got = _child(_READ_AND_WRITE_BACK, json.dumps(h), timeout=300)
    n = whole.numel()
    assert got["n"] == n and got["sum"] == whole[: n // 2].to(torch.int64).sum().item()
    torch.cuda.synchronize(dev)
    assert torch.equal(whole[n // 2:].cpu(), torch.full((n - n // 2,), 7, dtype=torch.uint8))
