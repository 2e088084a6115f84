"""Weight sync on two CUDA GPUs: correctness of the NCCL and CUDA IPC paths (bench/weight_sync_bench.py).

Runs the benchmark script on a small bf16 MoE (EP=2 trainer on GPU0 + GPU1, receiver on GPU1;
then a co-located trainer and receiver on GPU0) and checks what it recorded, not its speed:
- the verified sync's receiver digest equals the sender's, for each expert gather
  (intra-node CUDA IPC reads and NCCL point-to-point), and both gathers send identical bytes;
- a bucket corrupted after its checksums were taken is caught, the receiver keeps its version;
- after the trainer wrote fresh weights and synced without verification, the receiver's
  weights equal the trainer's exactly (per-tensor checksums of both, in plan order);
- the receiver's logits after the sync match the trainer's own Megatron logits within the
  script's stated bf16 tolerance, and did not before the sync.
Skipped without two GPUs. Speeds are reported in BENCHMARKS.md from the full-size run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_weight_sync_nccl_and_ipc_on_gpus(tmp_path):
    out = tmp_path / "wsb"
    cmd = [sys.executable, os.path.join(REPO, "bench/weight_sync_bench.py"), "--size", "counts", "--out", str(out),
           "--raw-gib", "0.25", "--skip-baseline", "--time-limit", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.load(open(out / "results.json"))
    for phase in ("nccl", "ipc"):
        r = res[phase]
        assert r["trainer_rc"] == 0 and not r["errors"], (phase, r.get("errors"), r.get("trainer_log_tail"))
        for gather, v in r["verify_by_gather"].items():
            assert v["match"], (phase, gather, v)
        assert r["verify"]["same_digest_every_gather"], phase
        assert r["corrupt"]["caught"] and r["corrupt"]["receiver_after"]["consistent"] is False, phase
        assert r["verify_after_corrupt"]["match"], phase
        w = r["weights_after_sync"]
        assert w["equal"] and w["receiver_digest_before"] != w["trainer_digest"], (phase, w)
        assert r["logits_after_sync"]["pass"], (phase, r["logits_after_sync"])
        assert r["logits_before_sync"]["cosine"] < 0.9, (phase, r["logits_before_sync"])
    assert res["nccl"]["auto_gather"].startswith("ipc"), res["nccl"]["auto_gather"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_driver_peer_copy_equals_the_source_and_runs_on_the_destination_stream():
    from skyrl_mega.weight_sync import cuda_copy

    assert cuda_copy.available()
    g = torch.Generator(device="cuda:1").manual_seed(0)
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:1", generator=g)
    dst = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda:0")
    cuda_copy.enable_peer_access(dst.device, src)
    side = torch.cuda.Stream(device="cuda:0")
    with torch.cuda.stream(side):
        cuda_copy.copy_on_dst_stream(dst[1:], src[:-1])  # odd offset, 64 MiB - 1 bytes
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()  # the copy was ordered on the side stream of the destination GPU
    assert torch.equal(dst[1:].cpu(), src[:-1].cpu()) and dst[0].item() == 0
    with pytest.raises(ValueError):
        cuda_copy.copy_on_dst_stream(dst[:10], src, 11)
