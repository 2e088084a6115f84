"""Context parallelism on CUDA in bf16 (marked gpu; skipped without it): CP=2 vs CP=1.

tests/workers/cp_worker.py (the CPU test's worker: one packed RL batch, R3 replaying random
valid routes) on the fast spec in bf16, once at CP=1 and once at CP=2. With one GPU the two CP
ranks share it over gloo (SKYRL_DIST_BACKEND=gloo: NCCL refuses two ranks on one GPU); with two
or more each rank has its own GPU and NCCL. Per-sample logprobs, the non-expert and all RL-loss
gradients and the weights after one update must agree within the bf16 tolerances below (the
figures are written to $SKYRL_GPU_RESULTS/cp_gpu.json when that is set).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _run(tmp, model, cp, extra=()):
    d = tmp / f"cp{cp}"
    d.mkdir()
    env = {"SKYRL_DIST_BACKEND": "gloo"} if cp > torch.cuda.device_count() else {}
    run_torchrun(os.path.join(REPO, "tests/workers/cp_worker.py"), cp,
                 [str(d), f"model.path={model}", "model.dtype=bfloat16", "model.spec=fast",
                  "optim.use_distributed_optimizer=false", f"parallel.cp={cp}", *extra],
                 timeout=900, log_file=str(d / "log.txt"), env=env)
    return load_file(d / "cp.safetensors"), json.load(open(d / "cp.json")), env


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cp2_equals_cp1_bf16(tiny_qwen3_moe, tmp_path):
    (ref, ref_info, _), (got, info, env) = _run(tmp_path, tiny_qwen3_moe, 1), _run(tmp_path, tiny_qwen3_moe, 2)
    n = ref_info["samples"]
    lp = max(float((got[f"lp_{i}"].float() - ref[f"lp_{i}"].float()).abs().max()) for i in range(n))
    weights = [k for k in ref if k.startswith("w.")]
    out = {"transport": env.get("SKYRL_DIST_BACKEND", "nccl"), "gpus": torch.cuda.device_count(),
           "device": torch.cuda.get_device_name(), "samples": n, "logprobs_max_abs_diff": lp,
           "dense_grads_rel_diff": _rel(got["dense_grads"], ref["dense_grads"]),
           "grads_rel_diff": _rel(got["grads"], ref["grads"]),
           "weights_after_update_rel_diff": max(_rel(got[k], ref[k]) for k in weights),
           "loss_cp1": ref_info["metrics"].get("loss"), "loss_cp2": info["metrics"].get("loss"),
           "tokens_seen_cp1": ref_info["tokens_seen"], "tokens_seen_cp2_rank0": info["tokens_seen"]}
    print(json.dumps(out))
    if os.environ.get("SKYRL_GPU_RESULTS"):
        with open(os.path.join(os.environ["SKYRL_GPU_RESULTS"], "cp_gpu.json"), "w") as f:
            json.dump(out, f, indent=1)
    assert all(got[f"lp_{i}"].shape == ref[f"lp_{i}"].shape for i in range(n))
    assert info["metrics"]["r3/coverage"] == ref_info["metrics"]["r3/coverage"] == 1.0
    cp1, cp2 = ref_info["tokens_seen"], info["tokens_seen"]  # each CP rank ran about half of the tokens
    assert max(cp2) < max(cp1) and sum(cp1) <= 2 * sum(cp2) <= 1.5 * sum(cp1), (cp1, cp2)
    assert abs(out["loss_cp2"] - out["loss_cp1"]) <= 2e-2 * max(1.0, abs(out["loss_cp1"]))
    assert lp < 0.1
    assert out["dense_grads_rel_diff"] < 5e-2 and out["grads_rel_diff"] < 5e-2
    assert out["weights_after_update_rel_diff"] < 1e-2
